//! The real models for the GPU: a Llama-shaped decoder built from candle-nn pieces (RMS norm,
//! rotary embeddings, grouped-query attention, SwiGLU MLP) with random weights made on the device
//! inside the model's route (every weight byte is its pool's memory, tagged weights), its KV in
//! a paged KV cache of the model's pool ([`PagedKvTensors`]: per layer a K and a V tensor
//! `[blocks, block_tokens, kv_heads, head_dim]`), every activation routed into the model's pool.
//!
//! A step runs real kernels over real shapes, as a paged-attention engine does (see
//! `paged_llama.rs`): projections and MLP batched over every token of the step, each token's K
//! and V written into its sequence's blocks; a decode step attended in one batch by the
//! paged-attention kernel, reading K and V in place through the block tables; a prefill's
//! attention by the crate's paged prefill kernel (causal flash attention over the blocks, in
//! place; before it, a prefill gathered each sequence's blocks and materialised its scores,
//! which made prefill at a 4k context a third of its rate at the start). A prefill is chunked: forwards of at most
//! `prefill_chunk` tokens (`--prefill-chunk`), each writing its tokens' K and V into the
//! sequence's blocks and attending over the cache so far (a later chunk reads the earlier ones
//! from the blocks), so a prefill's activations are bounded by the chunk, not the prompt.
//!
//! Each model is warmed, right after it is loaded, by the largest steps the engine can run: a
//! prefill chunk at the longest context and a decode of the largest batch all at the longest
//! context (block tables repeating one block, so no KV is needed for it); its base (weights
//! and the activations' peak, with a margin) is what it then held, and everything idle goes
//! back before the next model loads. Models beyond the resident count sleep at once, through
//! the host tier all models share ([`elastic_vmm::Pool::host_tier`]).

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::candle::{BlockShape, PagedKvTensors, PrefillPiece, TensorPool};
use elastic_vmm::kv::PagedKvConfig;
use elastic_vmm::route;
use elastic_vmm::{ModelConfig, ModelHandle, Pool, PoolConfig, SharedPool, SharedPoolConfig, Tag};

use crate::cluster::{paged_block_bytes, paged_bytes_for, BlockStore, PoolKv, Served};
use crate::engine::{Engine, EngineConfig, SeqView, StepModel};
use crate::paged_llama::{LayerCache, LlamaShape, PagedLlama, Piece, BLOCK_TOKENS};

pub const DTYPE: DType = DType::BF16;

/// A model size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Size {
    /// ~250 M parameters (0.5 GB bf16), 32 KiB of KV per token.
    Small,
    /// Llama-3.1-8B's shape (16 GB bf16), 128 KiB of KV per token.
    Llama8B,
}

impl Size {
    /// The size named `s` (`small` or `8b`).
    pub fn parse(s: &str) -> Result<Size, String> {
        [Size::Small, Size::Llama8B]
            .into_iter()
            .find(|z| z.name() == s)
            .ok_or_else(|| format!("unknown model size {s:?}: small or 8b"))
    }

    /// Bytes of its weights in the model's dtype, and of its rotary tables.
    pub fn weight_bytes(self) -> u64 {
        let c = self.config();
        let (h, kv) = (c.hidden as u64, (c.kv_heads * c.head_dim()) as u64);
        let layer = 2 * h + 2 * h * h + 2 * h * kv + 3 * h * c.intermediate as u64;
        let elems = 2 * c.vocab as u64 * h + c.layers as u64 * layer + h;
        let rotary = 2 * crate::paged_llama::MAX_POSITION as u64 * (c.head_dim() / 2) as u64;
        (elems + rotary) * DTYPE.size_in_bytes() as u64
    }

    /// Bytes of one KV block over all layers (K and V).
    pub fn block_bytes(self) -> u64 {
        let c = self.config();
        (2 * c.layers * BLOCK_TOKENS * c.kv_heads * c.head_dim() * DTYPE.size_in_bytes()) as u64
    }

    /// Its paged KV cache's shape for `max_blocks` blocks.
    pub fn kv_config(self, max_blocks: usize) -> PagedKvConfig {
        let c = self.config();
        PagedKvConfig::new(
            c.layers,
            c.kv_heads,
            c.head_dim(),
            BLOCK_TOKENS,
            DTYPE.size_in_bytes(),
            max_blocks,
        )
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Size::Small => "small",
            Size::Llama8B => "8b",
        }
    }

    /// Its shape.
    pub fn config(self) -> LlamaShape {
        match self {
            Size::Small => LlamaShape {
                hidden: 1024,
                intermediate: 2816,
                vocab: 32000,
                layers: 16,
                heads: 16,
                kv_heads: 8,
                eps: 1e-5,
                rope_theta: 10_000.0,
            },
            Size::Llama8B => LlamaShape {
                hidden: 4096,
                intermediate: 14336,
                vocab: 128256,
                layers: 32,
                heads: 32,
                kv_heads: 8,
                eps: 1e-5,
                rope_theta: 500_000.0,
            },
        }
    }
}

/// Elements of one f32 draw of random weights (32 MiB).
const DRAW_ELEMS: usize = 8 << 20;

/// Random weights made on the device. Each tensor is drawn in f32 (cuRAND has no bf16
/// normal) by the init candle-nn names for it, an unnamed (zero) init becoming N(0, 0.02), and
/// converted to the model's dtype. The draws go to `scratch`, a pool of their own: drawn in the
/// model's pool they left holes between the weights that no trim could give back (8B-shaped:
/// 14.98 GiB of weights held 32.97 GiB on the H100).
pub struct RandomWeights {
    /// Where the f32 draws go (a pool of their own, or the model's: they are freed slab by
    /// slab).
    pub scratch: Pool,
}

impl SimpleBackend for RandomWeights {
    fn get(
        &self,
        s: Shape,
        _name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let h = match h {
            Init::Const(0.0) => Init::Randn {
                mean: 0.0,
                stdev: 0.02,
            },
            h => h,
        };
        if let Init::Const(v) = h {
            return Tensor::ones(s, dtype, dev)?.affine(v, 0.0);
        }
        // Drawn a slab of rows at a time into the finished tensor, so the f32 draws in flight
        // stay small (a whole draw is twice the weight) and leave no holes between weights.
        let out = Tensor::zeros(s.clone(), dtype, dev)?;
        let dims = s.dims().to_vec();
        let rows = dims.first().copied().unwrap_or(1).max(1);
        let row_elems = (s.elem_count() / rows).max(1);
        let slab = (DRAW_ELEMS / row_elems).max(1);
        for first in (0..rows).step_by(slab) {
            let mut part = dims.clone();
            if let Some(d) = part.first_mut() {
                *d = slab.min(rows - first);
            }
            // Detached: a tensor made from a `Var` keeps its op graph (the f32 draw) alive
            // for backprop.
            let draw =
                route::with_route(&self.scratch, Tag::Scratch, || h.var(part, DType::F32, dev))
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))??;
            let piece = draw.as_tensor().to_dtype(dtype)?.detach();
            if dims.is_empty() {
                return Ok(piece);
            }
            out.slice_set(&piece, 0, first)?;
        }
        Ok(out)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        Err(candle_core::Error::Msg(format!(
            "random weights: {name} asked for without a shape"
        )))
    }

    fn contains_tensor(&self, _: &str) -> bool {
        true
    }
}

/// One model's compute.
pub struct LlamaModel {
    pool: Pool,
    /// The model's id (a routing refusal names it).
    id: String,
    llama: PagedLlama,
    kv: Arc<PagedKvTensors>,
    device: Device,
    /// Most tokens in one forward of a prefill.
    chunk: usize,
    /// Prefill attends by gathering the blocks, not by the prefill kernel (`serve probe
    /// --prefill gather`: the path before the kernel, measured beside it).
    prefill_by_gather: bool,
}

impl LlamaModel {
    /// Prefill by gathering the blocks (`true`) or by the prefill kernel (the default).
    pub fn set_prefill_by_gather(&mut self, gather: bool) {
        self.prefill_by_gather = gather;
    }

    /// [`PagedLlama::fingerprint`], its temporaries in the model's pool.
    pub fn fingerprint(&self) -> Result<Vec<f32>, String> {
        route::with_route(&self.pool, Tag::Activations, || self.llama.fingerprint())
            .map_err(|e| format!("route: {e}"))?
            .map_err(|e| format!("{}: fingerprint of the weights: {e}", self.id))
    }

    /// Whether the weights' fingerprint is `reference`'s (to a relative 1e-5: a lost byte
    /// moves a sum of squares far more).
    pub fn check_weights(&self, reference: &[f32]) -> Result<(), String> {
        let now = self.fingerprint()?;
        // A NaN compares unequal to everything, itself included: a changed weight.
        let same = |a: f32, b: f32| (a - b).abs() <= 1e-5 * b.abs().max(1e-30);
        let off = now.iter().zip(reference).position(|(a, b)| !same(*a, *b));
        match off {
            None if now.len() == reference.len() => Ok(()),
            _ => Err(format!(
                "{}: the weights changed: fingerprint {now:?}, loaded as {reference:?}",
                self.id
            )),
        }
    }

    fn run(&mut self, f: impl FnOnce(&mut Self) -> candle_core::Result<()>) -> Result<f64, String> {
        let t = Instant::now();
        let (pool, id) = (self.pool.clone(), self.id.clone());
        route::with_route(&pool, Tag::Activations, || f(self))
            .map_err(|e| format!("route: {e}"))?
            .map_err(|e| refusal(&id, e.to_string()))?;
        self.device.synchronize().map_err(|e| e.to_string())?;
        Ok(t.elapsed().as_secs_f64())
    }
}

/// `e` with the last refusal of routing (the numbers of an out-of-memory) when there was one.
fn refusal(id: &str, e: String) -> String {
    match route::last_refusal() {
        Some(r) if r.model == id => format!("{e} ({r})"),
        _ => e,
    }
}

/// A prefill's pieces: each sequence's new tokens, ending at its context.
fn prefill_pieces<'a>(seqs: &[SeqView<'a>]) -> Vec<Piece<'a>> {
    seqs.iter()
        .map(|s| {
            let len = (s.new_tokens as usize).min(s.context as usize);
            Piece {
                blocks: s.blocks,
                start: s.context as usize - len,
                len,
            }
        })
        .filter(|p| p.len > 0)
        .collect()
}

impl StepModel for LlamaModel {
    fn prefill(&mut self, seqs: &[SeqView]) -> Result<f64, String> {
        let pieces = prefill_pieces(seqs);
        let chunk = self.chunk;
        self.run(|m| {
            let kv: &dyn LayerCache = if m.prefill_by_gather {
                &Gathered {
                    kv: &m.kv,
                    decode: true,
                }
            } else {
                &*m.kv
            };
            m.llama.prefill_chunked(kv, &pieces, chunk).map(|_| ())
        })
    }

    fn decode(&mut self, seqs: &[SeqView]) -> Result<f64, String> {
        let pieces = decode_pieces(seqs);
        self.run(|m| m.llama.forward(&*m.kv, &pieces).map(|_| ()))
    }
}

/// A decode step's pieces: each sequence's last token.
fn decode_pieces<'a>(seqs: &[SeqView<'a>]) -> Vec<Piece<'a>> {
    seqs.iter()
        .map(|s| Piece {
            blocks: s.blocks,
            start: (s.context as usize).saturating_sub(1),
            len: 1,
        })
        .collect()
}

/// The cache without its prefill kernel, and without its decode kernel unless `decode`: a
/// forward over it gathers the blocks where the kernel is left out (with neither, the
/// reference the kernels are checked against). Writes and block order as the cache's.
struct Gathered<'a> {
    kv: &'a PagedKvTensors,
    decode: bool,
}

impl LayerCache for Gathered<'_> {
    fn layer(&self, l: usize) -> candle_core::Result<(Tensor, Tensor)> {
        self.kv.layer(l)
    }

    fn decode_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        table: &Tensor,
        lens: &Tensor,
        max_context: usize,
        scale: f32,
    ) -> Option<candle_core::Result<Tensor>> {
        self.decode.then(|| {
            self.kv
                .decode_attention(q, k, v, table, lens, max_context, scale)
        })?
    }

    fn write(
        &self,
        kc: &Tensor,
        vc: &Tensor,
        k: &Tensor,
        v: &Tensor,
        slots: &Tensor,
    ) -> Option<candle_core::Result<()>> {
        self.kv.write(kc, vc, k, v, slots)
    }

    fn token_major(&self, blocks: Tensor, kv: usize) -> candle_core::Result<Tensor> {
        self.kv.token_major(blocks, kv)
    }
}

impl LlamaModel {
    /// The model's layers.
    pub fn layers(&self) -> usize {
        self.llama.shape().layers
    }

    /// The largest difference between the logits of one decode step of `seqs` through the
    /// first `depth` layers attended by the paged-attention kernel and by gathering the blocks,
    /// and the largest logit. Each path writes the new token's K and V before reading them
    /// (the same in the first layer; deeper, each path's own), so each reads what it wrote.
    pub fn decode_check(&mut self, seqs: &[SeqView], depth: usize) -> Result<(f32, f32), String> {
        self.paths_check(&decode_pieces(seqs), depth)
    }

    /// As [`LlamaModel::decode_check`] for one prefill forward of `seqs`' new tokens (each
    /// `new_tokens` ending at `context`): the prefill kernel against attention by gather.
    pub fn prefill_check(&mut self, seqs: &[SeqView], depth: usize) -> Result<(f32, f32), String> {
        self.paths_check(&prefill_pieces(seqs), depth)
    }

    /// The logits of one forward of `pieces` through `depth` layers by the kernels and by
    /// gathering: their largest difference and the largest logit.
    fn paths_check(&mut self, pieces: &[Piece], depth: usize) -> Result<(f32, f32), String> {
        let (pool, id) = (self.pool.clone(), self.id.clone());
        route::with_route(
            &pool,
            Tag::Activations,
            || -> candle_core::Result<(f32, f32)> {
                let a = self
                    .llama
                    .forward_layers(&*self.kv, pieces, depth)?
                    .to_dtype(DType::F32)?;
                let b = self
                    .llama
                    .forward_layers(
                        &Gathered {
                            kv: &self.kv,
                            decode: false,
                        },
                        pieces,
                        depth,
                    )?
                    .to_dtype(DType::F32)?;
                let diff = (&a - &b)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?;
                let top = a.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                Ok((diff, top))
            },
        )
        .map_err(|e| format!("route: {e}"))?
        .map_err(|e| refusal(&id, e.to_string()))
    }
}

impl LayerCache for PagedKvTensors {
    fn layer(&self, l: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let e = candle_core::Error::wrap;
        Ok((self.k(l).map_err(e)?, self.v(l).map_err(e)?))
    }

    /// The crate's paged-attention op in the cache's block order: K and V read in place
    /// through the tables, no gather. Of the head sizes, query heads per KV head and dtypes it
    /// takes; anything else gathers.
    fn decode_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        table: &Tensor,
        lens: &Tensor,
        max_context: usize,
        scale: f32,
    ) -> Option<candle_core::Result<Tensor>> {
        let (heads, hd) = (q.dim(1).ok()?, q.dim(2).ok()?);
        let kvh = self.config().kv_heads;
        let supported = matches!(q.dtype(), DType::BF16 | DType::F16)
            && matches!(hd, 64 | 128)
            && kvh > 0
            && heads % kvh == 0
            && matches!(heads / kvh, 1 | 2 | 4 | 8);
        if !supported {
            return None;
        }
        Some(elastic_vmm::candle::paged_attention_decode_shaped(
            self.block_shape(),
            q,
            k,
            v,
            table,
            lens,
            max_context,
            scale,
        ))
    }

    /// The crate's paged-attention prefill op in the cache's block order: causal flash
    /// attention over the blocks in place. Of the head sizes and dtypes it takes; anything
    /// else gathers.
    fn prefill_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        table: &Tensor,
        spans: &[(usize, usize)],
        scale: f32,
    ) -> Option<candle_core::Result<Tensor>> {
        let (heads, hd) = (q.dim(1).ok()?, q.dim(2).ok()?);
        let kvh = self.config().kv_heads;
        // Where the op cannot run (its shared memory on a smaller GPU, a contiguous cache's
        // strided layer views) the engine gathers, as before the op.
        let supported = matches!(q.dtype(), DType::BF16 | DType::F16)
            && k.is_contiguous()
            && v.is_contiguous()
            && kvh > 0
            && heads % kvh == 0
            && elastic_vmm::candle::paged_prefill_supported(q.device(), hd);
        if !supported {
            return None;
        }
        let pieces: Vec<PrefillPiece> = spans
            .iter()
            .map(|&(start, len)| PrefillPiece { start, len })
            .collect();
        Some(elastic_vmm::candle::paged_attention_prefill_shaped(
            self.block_shape(),
            q,
            k,
            v,
            table,
            &pieces,
            scale,
        ))
    }

    /// The crate's write kernel, in the cache's block order: one launch per layer for K and
    /// one for V (on the H100 an 8B-shaped engine writing split-K blocks with it prefilled 512
    /// tokens at 0..512 in 20.3 ms, one writing token-major blocks with candle's
    /// `scatter_set` in 35.9 ms). A contiguous cache's strided layer views are refused by
    /// the kernel's checks, with the error: the engine makes per-layer caches.
    fn write(
        &self,
        kc: &Tensor,
        vc: &Tensor,
        k: &Tensor,
        v: &Tensor,
        slots: &Tensor,
    ) -> Option<candle_core::Result<()>> {
        let c = self.config();
        let (n, h, d) = (k.dim(0).ok()?, c.kv_heads, c.head_dim);
        let run = || {
            elastic_vmm::candle::paged_kv_write(
                self.block_shape(),
                &k.reshape((n, h, d))?,
                &v.reshape((n, h, d))?,
                kc,
                vc,
                slots,
            )
        };
        Some(run())
    }

    /// Blocks in the cache's order as token-major `[n, block_tokens, kv_heads, head_dim]`.
    fn token_major(&self, blocks: Tensor, kv: usize) -> candle_core::Result<Tensor> {
        let c = self.config();
        let (bt, h, d) = (c.block_tokens, c.kv_heads, c.head_dim);
        let n = blocks.dim(0)?;
        match (self.block_shape(), kv) {
            (BlockShape::TokenMajor, _) => Ok(blocks),
            // [n, h, bt, d]
            (BlockShape::HeadMajor, _) => blocks.permute((0, 2, 1, 3))?.contiguous(),
            // [n, h, d / x, bt, x]
            (BlockShape::SplitK, 0) => blocks
                .permute((0, 3, 1, 2, 4))?
                .contiguous()?
                .reshape((n, bt, h, d)),
            // [n, h, d, bt]
            (BlockShape::SplitK, _) => blocks.permute((0, 3, 1, 2))?.contiguous(),
        }
    }
}

impl BlockStore for Arc<PagedKvTensors> {
    fn alloc(&self, n: usize) -> Result<Vec<u32>, String> {
        BlockStore::alloc(self.cache(), n)
    }
    fn free(&self, ids: &[u32]) -> Result<(), String> {
        BlockStore::free(self.cache(), ids)
    }
    fn available(&self) -> usize {
        self.cache().available()
    }
    fn bytes_for(&self, blocks: usize) -> u64 {
        paged_bytes_for(self.cache(), blocks)
    }
    fn trim(&self) {
        self.cache().trim();
    }
}

/// The cluster's models on the GPU.
pub type GpuServed = Served<Arc<PagedKvTensors>, LlamaModel>;

/// What a GPU cluster is made of.
#[derive(Debug, Clone, Copy)]
pub struct GpuSizes {
    /// Model size.
    pub size: Size,
    /// Models.
    pub models: usize,
    /// Models the budget holds (bases and KV shares) and that stay awake after loading;
    /// the others sleep as soon as they are warm (only the sleep policy serves more models
    /// than fit).
    pub resident: usize,
    /// KV bytes per model under `static` (the budget is the resident models' bases plus this
    /// many KV bytes each, unless `budget` says otherwise).
    pub kv_share: u64,
    /// The budget all models share (bytes), instead of the one `kv_share` makes.
    pub budget: Option<u64>,
    /// Engine limits (`max_batch` and `max_context` size the warm-up).
    pub engine: EngineConfig,
    /// Most tokens in one forward of a prefill.
    pub prefill_chunk: usize,
    /// Stage sleeps through one host tier of at most this many bytes, shared by all models
    /// (`None`: no sleep expected; a sleep would pin staging of its own).
    pub host_tier: Option<u64>,
}

/// One engine process's model (`serve bench` on the GPU): a Llama of `size` with random weights
/// and activations in `pool` (a broker model's), its paged KV cache of `max_blocks` blocks in
/// `kv_pool` (another), warmed by the
/// largest steps `engine` runs. Field order is drop order: the model and cache before the
/// tensor pool that serves them.
pub struct EngineModel {
    /// The compute.
    pub model: LlamaModel,
    /// Its KV cache.
    pub kv: Arc<PagedKvTensors>,
    /// The cache's tensor pool.
    pub tensors: TensorPool,
    /// Bytes the model's pool held after loading and the warm-up, all idle memory given
    /// back: weights, with any gaps between them.
    pub held: u64,
    /// The warm-up's routed peak of live activations.
    pub act_peak: u64,
}

/// The block order `--block-shape` names: `token-major` (the crate's own), `head-major`
/// (FlashInfer's HND) or `split-k` (vLLM's paged-attention kernels, as mistral.rs and
/// candle-vllm allocate their caches).
pub fn parse_block_shape(s: &str) -> Result<BlockShape, String> {
    match s {
        "token-major" => Ok(BlockShape::TokenMajor),
        "head-major" => Ok(BlockShape::HeadMajor),
        "split-k" => Ok(BlockShape::SplitK),
        _ => Err(format!(
            "--block-shape {s:?}: token-major, head-major or split-k"
        )),
    }
}

/// Load and warm the model of one engine process, its KV cache's blocks in `shape`'s order;
/// see [`EngineModel`].
#[allow(clippy::too_many_arguments)]
pub fn engine_model(
    size: Size,
    pool: &Pool,
    kv_pool: &Pool,
    id: &str,
    max_blocks: usize,
    engine: EngineConfig,
    prefill_chunk: usize,
    shape: BlockShape,
) -> Result<EngineModel, String> {
    let e = |e: elastic_vmm::Error| e.to_string();
    let ce = |e: candle_core::Error| e.to_string();
    let device = Device::new_cuda(0).map_err(ce)?;
    let cfg = size.config();
    let llama = route::with_route(pool, Tag::Weights, || {
        let draws = RandomWeights {
            scratch: pool.clone(),
        };
        let vb = VarBuilder::from_backend(Box::new(draws), DTYPE, device.clone());
        PagedLlama::load(cfg, vb)
    })
    .map_err(e)?
    .map_err(|err| refusal(id, format!("loading {id}: {err}")))?;
    device.synchronize().map_err(ce)?;
    route::flush(pool);
    pool.trim().map_err(e)?;
    let tensors = TensorPool::new(kv_pool, &device).map_err(e)?;
    let kv = Arc::new(
        PagedKvTensors::with_shape(&tensors, size.kv_config(max_blocks), DTYPE, shape)
            .map_err(e)?,
    );
    let mut model = LlamaModel {
        pool: pool.clone(),
        id: id.to_string(),
        llama,
        kv: kv.clone(),
        device,
        chunk: prefill_chunk,
        prefill_by_gather: false,
    };
    let max_context = (engine.max_context as usize).max(1);
    warm(
        &mut model,
        &kv,
        prefill_chunk,
        engine.max_batch,
        max_context,
    )
    .map_err(|err| format!("warming {id}: {err}"))?;
    kv.cache().trim();
    let act_peak = route::stats(pool)
        .and_then(|r| r.tag(&Tag::Activations).map(|t| t.peak_bytes))
        .unwrap_or(0);
    route::flush(pool);
    pool.trim().map_err(e)?;
    let st = pool.stats();
    Ok(EngineModel {
        model,
        kv,
        tensors,
        held: st.mapped,
        act_peak,
    })
}

/// Tensor pools outlive nothing they serve: kept beside the cluster.
pub struct GpuCluster {
    /// The shared pool.
    pub gpu: SharedPool,
    /// The models.
    pub models: Vec<GpuServed>,
    /// Per model tensor pools (the paged KV tensors' home).
    pub tensor_pools: Vec<TensorPool>,
    /// The device.
    pub device: Device,
    /// The budget the models share.
    pub budget: u64,
    /// The host tier the models' sleeps go through.
    pub tier: Option<Pool>,
    _ballast: ModelHandle,
}

const GIB: f64 = (1u64 << 30) as f64;

/// Run the largest steps `model` can be asked for: one prefill forward of `chunk` tokens at
/// the longest context (from position 1 at least, so it reads its context from the blocks as
/// a later chunk does, the heavier of the two prefill paths), one decode of `max_batch`
/// sequences all at the longest context. The
/// block tables repeat one real block (attention reads `context` keys through them; the
/// writes land in that block), so the warm-up needs no KV beyond it.
pub fn warm(
    model: &mut LlamaModel,
    store: &Arc<PagedKvTensors>,
    chunk: usize,
    max_batch: usize,
    max_context: usize,
) -> Result<(), String> {
    let block = BlockStore::alloc(store, 1)?;
    let table = vec![block[0]; max_context.div_ceil(BLOCK_TOKENS)];
    let context = max_context as u32;
    let r = (|| {
        model.prefill(&[SeqView {
            blocks: &table,
            new_tokens: chunk.min(max_context.saturating_sub(1)).max(1) as u32,
            context,
        }])?;
        let seqs: Vec<SeqView> = (0..max_batch)
            .map(|_| SeqView {
                blocks: &table,
                new_tokens: 1,
                context,
            })
            .collect();
        model.decode(&seqs).map(|_| ())
    })();
    BlockStore::free(store, &block)?;
    r
}

/// Load `sizes.models` models with random weights on GPU 0, one after the other: each is
/// loaded, warmed by the largest steps the engine runs, its base measured (weights and the
/// activations' peak, a quarter of the activations more as margin), its idle memory given
/// back; models beyond `sizes.resident` then sleep through the shared host tier. The budget
/// is `sizes.budget`, else the resident models' bases plus `kv_share` each.
pub fn cluster(sizes: GpuSizes, progress: &dyn Fn(&str)) -> Result<GpuCluster, String> {
    let e = |e: elastic_vmm::Error| e.to_string();
    let ce = |e: candle_core::Error| e.to_string();
    let device = Device::new_cuda(0).map_err(ce)?;
    let backend = Arc::new(CudaBackend::new(0).map_err(e)?);
    // The budget is set once the bases are known; until then the device's free memory.
    let gpu = SharedPool::new(backend, SharedPoolConfig::new()).map_err(e)?;
    let device_budget = gpu.global_limit();
    let tier = match sizes.host_tier {
        Some(bytes) => {
            // Address space four times the memory: each sleep's copy is one range of the
            // tier, and ranges freed by wakes in another order fragment it (8 x 15 GiB models
            // in a 96 GiB range: "largest free range is 6.1 GiB" on the H100).
            let t = Pool::host_tier(
                0,
                PoolConfig::new(usize::try_from(bytes.saturating_mul(4)).unwrap_or(usize::MAX))
                    .physical_limit(bytes)
                    .name("host-tier"),
            )
            .map_err(e)?;
            progress(&format!(
                "host tier of up to {:.0} GiB for the models' sleeps: {}",
                bytes as f64 / GIB,
                t.backend_info().device_name
            ));
            Some(t)
        }
        None => None,
    };
    let cfg = sizes.size.config();
    let per_block =
        (2 * cfg.layers * BLOCK_TOKENS * cfg.kv_heads * cfg.head_dim() * DTYPE.size_in_bytes())
            as u64;
    // Room for every policy: a model may hold all the KV the budget has (address space only
    // until blocks are allocated).
    let kv_room = sizes.budget.unwrap_or(sizes.kv_share * sizes.models as u64);
    let max_blocks = (kv_room / per_block) as usize + 1;
    let max_context = sizes.engine.max_context as usize;
    if max_context == 0 {
        return Err("the engine's max_context sizes the warm-up: it must be set".into());
    }
    let mut models = Vec::new();
    let mut tensor_pools = Vec::new();
    // The weights' f32 draws: a model of its own, given back once every model is loaded.
    let scratch = gpu
        .register(ModelConfig::new(
            "weight-draws",
            2 * device_budget as usize,
            device_budget,
        ))
        .map_err(e)?;
    for i in 0..sizes.models {
        let t = Instant::now();
        let id = format!("{}-{i}", sizes.size.name());
        let handle = gpu
            .register(ModelConfig::new(
                &id,
                2 * device_budget as usize,
                device_budget,
            ))
            .map_err(e)?;
        if let Some(tier) = &tier {
            handle.stage_through(Some(tier.clone())).map_err(e)?;
        }
        let llama = route::with_route(&handle, Tag::Weights, || {
            let draws = RandomWeights {
                scratch: (*scratch).clone(),
            };
            let vb = VarBuilder::from_backend(Box::new(draws), DTYPE, device.clone());
            PagedLlama::load(cfg, vb)
        })
        .map_err(e)?
        .map_err(|err| refusal(&id, format!("loading {id}: {err}")))?;
        device.synchronize().map_err(ce)?;
        // The f32 draws the weights were converted from go back to the device.
        route::flush(&scratch);
        scratch.trim().map_err(e)?;
        handle.trim().map_err(e)?;
        let st = handle.model_stats().ok_or("model gone")?;
        let weights = st.in_use;
        progress(&format!(
            "loaded {id}: {:.2} GiB of random weights on the device in {:.1} s ({:.2} GiB mapped)",
            weights as f64 / GIB,
            t.elapsed().as_secs_f64(),
            st.used as f64 / GIB
        ));
        let tensors = TensorPool::new(&handle, &device).map_err(e)?;
        let kv = Arc::new(
            PagedKvTensors::new(&tensors, sizes.size.kv_config(max_blocks), DTYPE).map_err(e)?,
        );
        let block_bytes = paged_block_bytes(kv.cache());
        let mut model = LlamaModel {
            pool: (*handle).clone(),
            id: id.clone(),
            llama,
            kv: kv.clone(),
            device: device.clone(),
            chunk: sizes.prefill_chunk,
            prefill_by_gather: false,
        };
        let t = Instant::now();
        warm(
            &mut model,
            &kv,
            sizes.prefill_chunk,
            sizes.engine.max_batch,
            max_context,
        )
        .map_err(|err| format!("warming {id}: {err}"))?;
        // The warm-up's KV block is no activation: its pages go back before the count.
        kv.cache().trim();
        let peak_act = route::stats(&handle)
            .and_then(|r| r.tag(&Tag::Activations).map(|t| t.peak_bytes))
            .unwrap_or(0);
        // The routed peak of live activations: what the warm-up left mapped is no measure
        // (freed blocks stay mapped as idle memory, given back on a trim or when the budget
        // needs them; the 8B warm-up left 62.6 GiB mapped for a peak of 1.5 GiB).
        let act = peak_act;
        let base = weights + act + act / 4;
        handle.trim().map_err(e)?;
        let after = handle.model_stats().map_or(0, |s| s.used);
        progress(&format!(
            "warmed {id} in {:.1} s (prefill chunk {} at context {max_context}, decode of {}): activations {:.2} GiB (routed peak {:.2}), base {:.2} GiB; {:.2} GiB mapped after trim",
            t.elapsed().as_secs_f64(),
            sizes.prefill_chunk,
            sizes.engine.max_batch,
            act as f64 / GIB,
            peak_act as f64 / GIB,
            base as f64 / GIB,
            after as f64 / GIB
        ));
        let pkv = PoolKv::new(
            kv,
            handle.clone(),
            max_blocks,
            BLOCK_TOKENS as u32,
            block_bytes,
        );
        if i >= sizes.resident {
            let t = Instant::now();
            gpu.set_guarantee(handle.id(), 0).map_err(e)?;
            handle
                .sleep(&crate::cluster::sleep_policy())
                .map_err(|err| format!("sleep {id}: {err}"))?;
            progress(&format!(
                "{id} asleep (beyond the {} resident): {:.2} GiB to the host in {:.1} s",
                sizes.resident,
                handle.model_stats().map_or(0, |s| s.asleep) as f64 / GIB,
                t.elapsed().as_secs_f64()
            ));
        }
        models.push(Served {
            handle,
            engine: Engine::new(pkv, model, sizes.engine),
            base,
            guarantee: 0,
        });
        tensor_pools.push(tensors);
    }
    scratch.trim().map_err(e)?;
    drop(scratch);
    // Make the shared host tier ready once: two models' bases mapped ahead, so a sleep on
    // the request path copies at link speed instead of creating host memory (a cold 15 GiB
    // sleep took 4 s on the H100 and pushed a woken model's p99 TTFT to 3.95 s).
    if let Some(t) = &tier {
        let most = models.iter().map(|m| m.base).max().unwrap_or(0);
        let t0 = Instant::now();
        let made = t.prefill(most.saturating_mul(2)).map_err(e)?;
        progress(&format!(
            "host tier ready: {:.2} GiB mapped ahead in {:.1} s (once per process, shared by the models' sleeps)",
            made as f64 / GIB,
            t0.elapsed().as_secs_f64()
        ));
    }
    let bases = models.iter().map(|m| m.base).sum::<u64>();
    let resident = sizes.resident.clamp(1, sizes.models) as u64;
    let budget = sizes
        .budget
        .unwrap_or(bases / sizes.models as u64 * resident + sizes.kv_share * resident);
    if budget > device_budget {
        return Err(format!(
            "the budget of {:.2} GiB (bases and {} x {:.2} GiB of KV, or --budget-gib) exceeds the device's {:.2} GiB: lower --kv-share-gib, --resident or --budget-gib",
            budget as f64 / GIB,
            resident,
            sizes.kv_share as f64 / GIB,
            device_budget as f64 / GIB
        ));
    }
    // The device's memory beyond the budget is held back by a model that only holds a
    // guarantee (nothing mapped): no policy can use it.
    let rest = device_budget - budget;
    let ballast = gpu
        .register(ModelConfig::new("held-back", 1 << 21, rest.max(1)).guarantee(rest))
        .map_err(|err| {
            format!(
                "holding back {:.2} GiB of the device beyond the budget: {err}",
                rest as f64 / GIB
            )
        })?;
    Ok(GpuCluster {
        gpu,
        models,
        tensor_pools,
        device,
        budget,
        tier,
        _ballast: ballast,
    })
}
