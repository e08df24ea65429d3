//! The candle face of a [`PagedKv`]: per-layer K and V tensors (or one contiguous tensor) over
//! the cache's region, ordinary candle tensors any kernel can take, including paged-attention
//! kernels that read blocks through a block table.
//!
//! Every page of the tensors is mapped: under allocated blocks with memory of their own, under
//! the others read-only to the pool's zero page. So a kernel that **reads** any block reads
//! real data or zeros, never faults. A kernel that **writes** into a block that is not
//! allocated faults (CUDA: an illegal-address error, which poisons the CUDA context of the
//! process): write only blocks [`PagedKvTensors::alloc`] gave and [`PagedKvTensors::free`] has
//! not taken back, as any paged-attention engine does.
//!
//! Releasing pages waits for the GPU to finish the work queued before (the device's ordering
//! stream, see [`crate::candle`]), so a kernel queued on a block before its `free` never sees
//! its page go. Dropping the cache while tensors of it live keeps the memory mapped until they
//! are gone ([`crate::candle::reap_orphans`]).

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;

use candle_core::{DType, Device, IndexOp, Shape, Tensor};
use parking_lot::Mutex;

use super::orphans::{self, Orphan};
use super::retire::{Batch, Wait};
use super::slices::{
    device_stream, last_use_passed, ordering_stream, Fence, Fences, SliceFactory, Tracker,
    LEGACY_STREAM,
};
use super::{candle_error, element_size, TensorPool};
use crate::error::{Error, Result};
use crate::kv::{
    BlockId, Compaction, CompactionGain, KvLayout, KvMove, PagedKv, PagedKvConfig, PagedKvStats,
    Watermarks,
};

/// The order of a block's elements as the per-layer tensors present them: the engines'
/// kernels each read their own. Every shape spans the same bytes per block (`block_tokens *
/// kv_heads * head_dim` elements of K, as many of V), so the cache underneath, its ids, moves
/// and budget are the same whatever the shape; only the tensors' dimensions differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BlockShape {
    /// K and V `[blocks, block_tokens, kv_heads, head_dim]` (FlashInfer's NHD): the order
    /// [`super::paged_attention_decode`] and [`super::paged_attention_prefill`] read (they
    /// cannot tell another 4-d shape from this one: give other orders to
    /// [`super::paged_attention_decode_shaped`] and [`super::paged_attention_prefill_shaped`]),
    /// and [`KvLayout::Contiguous`]'s order.
    #[default]
    TokenMajor,
    /// K and V `[blocks, kv_heads, block_tokens, head_dim]`: FlashInfer's HND paged layout,
    /// as mistral.rs's FlashInfer path allocates it.
    HeadMajor,
    /// vLLM's paged-attention kernels (mistral.rs, candle-vllm, attention-rs): K `[blocks,
    /// kv_heads, head_dim / x, block_tokens, x]` with `x` elements in 16 bytes (8 for f16 and
    /// bf16), V `[blocks, kv_heads, head_dim, block_tokens]`.
    SplitK,
}

impl BlockShape {
    /// Layer tensors' dimensions for K (`kv = 0`) and V (`kv = 1`) of `c`, elements of
    /// `elem` bytes; an error where the shape cannot hold the cache's.
    fn dims(self, c: &PagedKvConfig, elem: usize, kv: usize) -> Result<Vec<usize>> {
        let (n, bt, h, d) = (c.max_blocks, c.block_tokens, c.kv_heads, c.head_dim);
        Ok(match (self, kv) {
            (BlockShape::TokenMajor, _) => vec![n, bt, h, d],
            (BlockShape::HeadMajor, _) => vec![n, h, bt, d],
            (BlockShape::SplitK, 0) => {
                let x = 16 / elem.max(1);
                if elem == 0 || 16 % elem != 0 || d % x != 0 {
                    return Err(Error::InvalidArgument(format!(
                        "BlockShape::SplitK: head_dim {d} is not a multiple of x = {x} ({elem}-byte elements in 16 bytes)"
                    )));
                }
                vec![n, h, d / x, bt, x]
            }
            (BlockShape::SplitK, _) => vec![n, h, d, bt],
        })
    }
}

/// A paged KV cache as candle tensors; see the module documentation. `Send + Sync`, every
/// method takes `&self`.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use candle_core::{DType, Device, Tensor};
/// use elastic_vmm::candle::{PagedKvTensors, TensorPool};
/// use elastic_vmm::kv::PagedKvConfig;
/// use elastic_vmm::Pool;
///
/// let device = Device::new_cuda(0)?;
/// let tensors = TensorPool::new(&Pool::cuda(0, 64 << 30)?, &device)?;
/// // 32 layers, 8 KV heads of 128, 16 tokens per block, 8192 blocks: nothing mapped yet.
/// let cache = PagedKvTensors::new(&tensors, PagedKvConfig::new(32, 8, 128, 16, 2, 8192), DType::F16)?;
/// let ids = cache.alloc(4)?; // mapped in all 64 tensors
/// let table = Tensor::new(&[ids[2] as u32, ids[0] as u32, 7000], &device)?; // 7000: unbacked
/// let k0 = cache.k(0)?.index_select(&table, 0)?; // [3, 16, 8, 128]; block 7000 reads zeros
/// cache.free(&ids)?;
/// # drop(k0); Ok(()) }
/// ```
pub struct PagedKvTensors {
    core: Arc<Core>,
    shape: BlockShape,
}

/// Fields drop in order: the tensors, the GPU past its work, then the cache (pages unmapped).
struct Core {
    tensors: Mutex<Vec<Tensor>>,
    trackers: Mutex<Vec<Tracker>>,
    finish: FinishGpu,
    kv: PagedKv,
    slices: Arc<SliceFactory>,
    fences: Arc<Fences>,
    device: Device,
    dtype: DType,
}

/// Waits, when dropped, for the GPU to finish everything queued on the device's ordering
/// stream, unless it is known to be past every use already.
struct FinishGpu {
    fences: Arc<Fences>,
    needed: bool,
}

impl Drop for FinishGpu {
    fn drop(&mut self) {
        if self.needed {
            if let Err(e) = self.fences.synchronize() {
                tracing::error!(error = %e, "waiting for the GPU before unmapping a paged KV cache failed");
            }
        }
    }
}

/// The cache underneath, for a [`crate::kv::BlockPool::over_shared`] that hands out its
/// blocks while these tensors present them to kernels.
impl AsRef<PagedKv> for PagedKvTensors {
    fn as_ref(&self) -> &PagedKv {
        &self.core.kv
    }
}

impl fmt::Debug for PagedKvTensors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagedKvTensors")
            .field("dtype", &self.core.dtype)
            .field("kv", &self.core.kv)
            .finish()
    }
}

impl PagedKvTensors {
    /// A cache shaped by `config` (its `elem_bytes` is set from `dtype`) in `tensors`' pool,
    /// on its device. Errors as [`PagedKv::new`], and for a dtype candle's CUDA backend does
    /// not store.
    pub fn new(
        tensors: &TensorPool,
        config: PagedKvConfig,
        dtype: DType,
    ) -> Result<PagedKvTensors> {
        Self::with_shape(tensors, config, dtype, BlockShape::TokenMajor)
    }

    /// [`PagedKvTensors::new`] with each layer's K and V in `shape`'s order (per-layer
    /// tensors only: a [`KvLayout::Contiguous`] cache is token-major). Errors as `new`, and
    /// where the shape does not fit the config (nothing is mapped then).
    pub fn with_shape(
        tensors: &TensorPool,
        mut config: PagedKvConfig,
        dtype: DType,
        shape: BlockShape,
    ) -> Result<PagedKvTensors> {
        config.elem_bytes = element_size(dtype)?;
        if shape != BlockShape::TokenMajor && config.layout != KvLayout::PerLayer {
            return Err(Error::InvalidArgument(format!(
                "{shape:?} blocks need per-layer tensors (KvLayout::PerLayer); a contiguous cache is token-major"
            )));
        }
        // Checked before anything is made.
        let per_kv = [
            shape.dims(&config, config.elem_bytes, 0)?,
            shape.dims(&config, config.elem_bytes, 1)?,
        ];
        // Candle ops read the tensors whole: every page must be mapped (memory or zeros).
        if config.zero_unbacked == Some(false) {
            return Err(Error::InvalidArgument(
                "candle tensors over a paged KV cache read every page: zero_unbacked(false) would leave pages a kernel reads unmapped".into(),
            ));
        }
        let kv = PagedKv::new(tensors.pool(), config.clone())?;
        let fences = tensors.fences().clone();
        let wait = fences.clone();
        // A release unmaps pages (or aliases them to the zero page) only once the GPU has run
        // what was queued before it.
        kv.set_before_release(Box::new(move || wait.synchronize()));
        let (c, blocks) = (&config, config.max_blocks);
        // Tensor t is layer t / 2's K (t even) or V; one tensor for a contiguous cache.
        let dims = |t: usize| -> Vec<usize> {
            match c.layout {
                KvLayout::PerLayer => per_kv[t % 2].clone(),
                KvLayout::Contiguous => {
                    vec![blocks, c.layers, 2, c.block_tokens, c.kv_heads, c.head_dim]
                }
            }
        };
        let mut made = Vec::with_capacity(kv.tensors());
        let mut trackers = Vec::with_capacity(kv.tensors());
        for t in 0..kv.tensors() {
            let addr = kv.tensor_addr(t).ok_or_else(|| {
                Error::InvalidArgument(format!("paged KV tensor {t} of {}", kv.tensors()))
            })?;
            let ctx = tensors.slices().take_context()?;
            // SAFETY: tensor `t` spans `dims` elements of `dtype` at `addr` in the cache's
            // region, every page of it mapped (memory, or the zero page read-only) for as long
            // as the cache lives; the cache lives until this tracker is unique (the drop below
            // hands it to the orphans otherwise).
            let (tensor, tracker) = unsafe {
                tensors
                    .slices()
                    .tensor(ctx, addr, Shape::from(dims(t)), dtype)?
            };
            made.push(tensor);
            trackers.push(tracker);
        }
        Ok(PagedKvTensors {
            core: Arc::new(Core {
                tensors: Mutex::new(made),
                trackers: Mutex::new(trackers),
                finish: FinishGpu {
                    fences: fences.clone(),
                    needed: true,
                },
                kv,
                slices: tensors.slices().clone(),
                fences,
                device: tensors.device().clone(),
                dtype,
            }),
            shape,
        })
    }

    /// The block allocator underneath (ids, stats, trim).
    pub fn cache(&self) -> &PagedKv {
        &self.core.kv
    }

    /// The candle device.
    pub fn device(&self) -> &Device {
        &self.core.device
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.core.dtype
    }

    /// The order of the layer tensors' elements.
    pub fn block_shape(&self) -> BlockShape {
        self.shape
    }

    fn tensor(&self, t: usize) -> Result<Tensor> {
        self.core
            .tensors
            .lock()
            .get(t)
            .cloned()
            .ok_or_else(|| Error::InvalidArgument(format!("paged KV tensor {t} is gone")))
    }

    fn layer_of(&self, layer: usize, kv: usize) -> Result<Tensor> {
        let c = self.core.kv.config();
        if layer >= c.layers {
            return Err(Error::InvalidArgument(format!(
                "paged KV cache: layer {layer} of {}",
                c.layers
            )));
        }
        match c.layout {
            KvLayout::PerLayer => self.tensor(2 * layer + kv),
            KvLayout::Contiguous => self
                .tensor(0)?
                .i((.., layer, kv))
                .map_err(candle_error("paged KV layer view")),
        }
    }

    /// Layer `layer`'s K: `[max_blocks, block_tokens, kv_heads, head_dim]` (contiguous for
    /// [`KvLayout::PerLayer`], a strided view of the one tensor for
    /// [`KvLayout::Contiguous`]), or in the order of the cache's [`BlockShape`]. Reads of any
    /// block are defined (zeros where unallocated); write only allocated blocks.
    pub fn k(&self, layer: usize) -> Result<Tensor> {
        self.layer_of(layer, 0)
    }

    /// Layer `layer`'s V; as [`PagedKvTensors::k`].
    pub fn v(&self, layer: usize) -> Result<Tensor> {
        self.layer_of(layer, 1)
    }

    /// The one tensor `[max_blocks, layers, 2, block_tokens, kv_heads, head_dim]` of a
    /// [`KvLayout::Contiguous`] cache; `None` for per-layer tensors.
    pub fn contiguous(&self) -> Option<Tensor> {
        (self.core.kv.config().layout == KvLayout::Contiguous)
            .then(|| self.tensor(0).ok())
            .flatten()
    }

    /// [`PagedKv::alloc`].
    pub fn alloc(&self, n: usize) -> Result<Vec<BlockId>> {
        self.core.kv.alloc(n)
    }

    /// [`PagedKv::free`]; pages go back only after the GPU ran what was queued before.
    pub fn free(&self, ids: &[BlockId]) -> Result<()> {
        self.core.kv.free(ids)
    }

    /// [`PagedKv::compact`], with the copy queued on the device's ordering stream (see
    /// [`crate::candle`]): it runs after every kernel candle queued before on this device, from
    /// any thread, and candle's kernels queued after the call run after it. Rename the moved
    /// ids ([`Compaction::rename`]) in the block tables before queuing kernels that use them;
    /// the old blocks' pages are released after the call, on the compaction's give-back
    /// thread ([`Compaction::give_back`]), once the GPU ran what was queued before.
    pub fn compact(&self, max_moves: usize) -> Result<Compaction> {
        let stream = match &self.core.device {
            Device::Cuda(d) => ordering_stream(device_stream(d)),
            _ => LEGACY_STREAM,
        };
        self.core.kv.compact_on(max_moves, stream)
    }

    /// [`PagedKv::move_to`] of `ids` to `dst` (a cache of the same shape on other memory, e.g.
    /// a [`PagedKv`] on a host tier): the copies run after every kernel candle queued before on
    /// this device (the ordering stream, as [`PagedKvTensors::compact`]), and the host does not
    /// wait. Until the move is waited for the blocks are pinned; once it is, they are freed
    /// here (their pages go back after the GPU ran what was queued on them).
    pub fn move_out(&self, ids: &[BlockId], dst: &PagedKv) -> Result<KvMove> {
        match self.stream() {
            // SAFETY: the device's ordering stream is live for as long as the device.
            Some(stream) => unsafe { self.core.kv.move_to_after(ids, dst, stream) },
            None => self.core.kv.move_to(ids, dst),
        }
    }

    /// Blocks `ids` of `src` (a cache of the same shape, e.g. on a host tier) moved into this
    /// cache ([`PagedKv::move_to`]); [`KvMove::destinations`] are their ids here. Candle's
    /// kernels queued on this device after the call run after the copies (the ordering stream
    /// waits for them), so a block table naming the new ids can be used at once.
    pub fn move_in(&self, src: &PagedKv, ids: &[BlockId]) -> Result<KvMove> {
        let Some(stream) = self.stream() else {
            return src.move_to(ids, &self.core.kv);
        };
        // The destinations may be blocks freed with kernels still queued on them: the copies
        // run after those (the ordering stream), and the kernels queued next after the copies.
        // SAFETY: as in `move_out`.
        let m = unsafe { src.move_to_after(ids, &self.core.kv, stream) }?;
        // SAFETY: as in `move_out`.
        if let Err(e) = unsafe { m.order_before(stream) } {
            // The move stands (returning the error would drop it, settled, with its new ids
            // lost): once its copies are done there is nothing left to order.
            tracing::warn!(error = %e, "ordering candle's stream after a move in failed; waiting for its copies");
            while !m.is_done() {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
        Ok(m)
    }

    /// The device's ordering stream, on CUDA.
    fn stream(&self) -> Option<u64> {
        match &self.core.device {
            Device::Cuda(d) => Some(ordering_stream(device_stream(d))),
            _ => None,
        }
    }

    /// [`PagedKv::compaction_gain`].
    pub fn compaction_gain(&self) -> CompactionGain {
        self.core.kv.compaction_gain()
    }

    /// [`PagedKv::available`].
    pub fn available(&self) -> usize {
        self.core.kv.available()
    }

    /// [`PagedKv::stats`].
    pub fn stats(&self) -> PagedKvStats {
        self.core.kv.stats()
    }

    /// The watermarks the cache keeps, if any.
    pub fn watermarks(&self) -> Option<Watermarks> {
        self.core.kv.config().watermarks
    }

    /// The cache's config.
    pub fn config(&self) -> &PagedKvConfig {
        self.core.kv.config()
    }
}

impl Core {
    /// Drop our own tensors, recycle the contexts of trackers whose tensors are all gone;
    /// returns how many still have tensors.
    fn prune(&self) -> usize {
        self.tensors.lock().clear();
        let mut trackers = std::mem::take(&mut *self.trackers.lock());
        let mut live = Vec::new();
        for mut t in trackers.drain(..) {
            if t.is_unique() {
                self.slices.retire(t);
            } else {
                live.push(t);
            }
        }
        let n = live.len();
        *self.trackers.lock() = live;
        n
    }
}

impl Drop for PagedKvTensors {
    fn drop(&mut self) {
        let live = self.core.prune();
        if live > 0 {
            tracing::warn!(
                live_tensors = live,
                "paged KV cache dropped while tensors of it live; its memory stays mapped until they are dropped (see elastic_vmm::candle::reap_orphans)"
            );
            orphans::adopt(Box::new(OrphanPaged {
                core: self.core.clone(),
                last_use: VecDeque::new(),
            }));
        }
    }
}

/// A cache dropped while its tensors live: kept whole until they are gone and the GPU passed a
/// fence recorded after that.
struct OrphanPaged {
    core: Arc<Core>,
    last_use: VecDeque<Batch<(), Fence>>,
}

impl Orphan for OrphanPaged {
    fn reap(&mut self, wait: Wait) -> bool {
        if self.last_use.is_empty() && self.core.prune() > 0 {
            return false;
        }
        if !last_use_passed(
            &self.core.fences,
            &mut self.last_use,
            wait,
            "paged KV cache",
        ) {
            return false;
        }
        if let Some(core) = Arc::get_mut(&mut self.core) {
            core.finish.needed = false;
        }
        true
    }
}
