//! The real models for the GPU: a Llama-shaped decoder built from candle-nn pieces (RMS norm,
//! rotary embeddings, grouped-query attention, SwiGLU MLP) with random weights made on the device
//! inside the model's route (every weight byte is its pool's memory, tagged weights), its KV in
//! a paged KV cache of the model's pool ([`PagedKvTensors`]: per layer a K and a V tensor
//! `[blocks, block_tokens, kv_heads, head_dim]`), every activation routed into the model's pool.
//!
//! A step runs real kernels over real shapes, as a paged-attention engine does:
//! - the projections and the MLP are one batched matmul over every token of the step (all the
//!   new tokens of a prefill's sequences, one token per sequence of a decode batch);
//! - each token's K and V (after the rotary embedding) are written into its slot of its
//!   sequence's blocks (`scatter_set` on the layer's tensor viewed as `[blocks * block_tokens,
//!   kv_heads * head_dim]`: one kernel per layer for K and one for V, in place);
//! - attention is per sequence: its blocks gathered by its block table (`index_select`, as
//!   `examples/paged_kv_attention.rs` checks bit for bit against a static cache), its queries
//!   against its whole context (causal within a prefill's new tokens);
//! - only each sequence's last token goes through the final norm and the LM head.
//!
//! A prefill goes in forwards of at most [`PREFILL_CHUNK`] tokens (a longer context, e.g. a
//! recomputed one, in pieces; a piece attends to the earlier pieces through the blocks).

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Module, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Embedding, Init, Linear, VarBuilder};
use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::candle::{PagedKvTensors, TensorPool};
use elastic_vmm::kv::PagedKvConfig;
use elastic_vmm::route;
use elastic_vmm::{ModelConfig, ModelHandle, SharedPool, SharedPoolConfig, Tag};

use crate::cluster::{paged_block_bytes, paged_bytes_for, BlockStore, PoolKv, Served};
use crate::engine::{Engine, EngineConfig, SeqView, StepModel};

const DTYPE: DType = DType::BF16;
/// Tokens per KV block (vLLM's default).
pub const BLOCK_TOKENS: usize = 16;
/// Most tokens in one forward of a prefill: longer contexts (recomputed ones) go in pieces,
/// which bounds the attention's `[heads, n, context]` scores.
pub const PREFILL_CHUNK: usize = 2048;
/// Positions the rotary tables cover (a longer context is an error naming it).
const MAX_POSITION: usize = 32768;

/// A model's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaShape {
    /// Hidden size.
    pub hidden: usize,
    /// MLP size.
    pub intermediate: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// RMS norm epsilon.
    pub eps: f64,
    /// Rotary base.
    pub rope_theta: f64,
}

impl LlamaShape {
    /// Elements per head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

/// A model size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Size {
    /// ~250 M parameters (0.5 GB bf16), 32 KiB of KV per token.
    Small,
    /// Llama-3.1-8B's shape (16 GB bf16), 128 KiB of KV per token.
    Llama8B,
}

impl Size {
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

/// Random weights made on the device. Each tensor is drawn in f32 (cuRAND has no bf16
/// normal) by the init candle-nn names for it, an unnamed (zero) init becoming N(0, 0.02), and
/// converted to the model's dtype.
struct RandomWeights;

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
        h.var(s, DType::F32, dev)?.as_tensor().to_dtype(dtype)
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

/// One decoder layer's weights.
struct Layer {
    attn_norm: Tensor,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    mlp_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// A Llama-shaped decoder over a paged KV cache.
struct PagedLlama {
    shape: LlamaShape,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    /// Rotary tables `[MAX_POSITION, head_dim / 2]`.
    cos: Tensor,
    sin: Tensor,
}

/// A piece of a sequence in one forward: its block table, the position of its first new token
/// and how many new tokens.
struct Piece<'a> {
    blocks: &'a [u32],
    start: usize,
    len: usize,
}

fn rotary_tables(shape: &LlamaShape, dev: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let half = shape.head_dim() / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| {
            1.0 / shape
                .rope_theta
                .powf(2.0 * i as f64 / shape.head_dim() as f64) as f32
        })
        .collect();
    let inv = Tensor::from_vec(inv, (1, half), &Device::Cpu)?;
    let pos = Tensor::arange(0u32, MAX_POSITION as u32, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .reshape((MAX_POSITION, 1))?;
    let freqs = pos.broadcast_mul(&inv)?;
    let to = |t: Tensor| t.to_dtype(DTYPE)?.to_device(dev);
    Ok((to(freqs.cos()?)?, to(freqs.sin()?)?))
}

impl PagedLlama {
    fn load(shape: LlamaShape, vb: VarBuilder) -> candle_core::Result<Self> {
        let (h, hd) = (shape.hidden, shape.head_dim());
        let lin = |i: usize, o: usize, vb: VarBuilder| candle_nn::linear_no_bias(i, o, vb);
        let ones = |vb: VarBuilder| vb.get_with_hints(h, "weight", Init::Const(1.0));
        let mut layers = Vec::with_capacity(shape.layers);
        for l in 0..shape.layers {
            let vb = vb.pp(format!("layers.{l}"));
            layers.push(Layer {
                attn_norm: ones(vb.pp("input_layernorm"))?,
                wq: lin(h, shape.heads * hd, vb.pp("q_proj"))?,
                wk: lin(h, shape.kv_heads * hd, vb.pp("k_proj"))?,
                wv: lin(h, shape.kv_heads * hd, vb.pp("v_proj"))?,
                wo: lin(shape.heads * hd, h, vb.pp("o_proj"))?,
                mlp_norm: ones(vb.pp("post_attention_layernorm"))?,
                gate: lin(h, shape.intermediate, vb.pp("gate_proj"))?,
                up: lin(h, shape.intermediate, vb.pp("up_proj"))?,
                down: lin(shape.intermediate, h, vb.pp("down_proj"))?,
            });
        }
        let (cos, sin) = rotary_tables(&shape, vb.device())?;
        Ok(PagedLlama {
            shape,
            embed: candle_nn::embedding(shape.vocab, h, vb.pp("embed_tokens"))?,
            layers,
            norm: ones(vb.pp("norm"))?,
            lm_head: lin(h, shape.vocab, vb.pp("lm_head"))?,
            cos,
            sin,
        })
    }

    /// One forward over `pieces` (their new tokens written into their blocks, each attending
    /// to its whole context); logits of each piece's last token, `[pieces, vocab]`.
    fn forward(&self, kv: &PagedKvTensors, pieces: &[Piece]) -> candle_core::Result<Tensor> {
        let dev = kv.device().clone();
        let s = &self.shape;
        let (hd, kvd) = (s.head_dim(), s.kv_heads * s.head_dim());
        let bt = BLOCK_TOKENS;
        // Every token's position and its row in the cache (`block * block_tokens + slot`).
        let mut pos = Vec::new();
        let mut rows = Vec::new();
        let mut last = Vec::with_capacity(pieces.len());
        for p in pieces {
            if p.len == 0 {
                candle_core::bail!("a step piece with no new tokens");
            }
            let end = p.start + p.len;
            if end > MAX_POSITION || end.div_ceil(bt) > p.blocks.len() {
                candle_core::bail!(
                    "a context of {end} tokens: {} blocks of {bt} held, {MAX_POSITION} positions at most",
                    p.blocks.len()
                );
            }
            for t in p.start..end {
                pos.push(t as u32);
                rows.push(p.blocks[t / bt] * bt as u32 + (t % bt) as u32);
            }
            last.push((pos.len() - 1) as u32);
        }
        let n = pos.len();
        let pos = Tensor::new(pos.as_slice(), &dev)?;
        let cos = self.cos.index_select(&pos, 0)?.reshape((n, 1, hd / 2))?;
        let sin = self.sin.index_select(&pos, 0)?.reshape((n, 1, hd / 2))?;
        let rows = Tensor::new(rows.as_slice(), &dev)?
            .reshape((n, 1))?
            .broadcast_as((n, kvd))?
            .contiguous()?;
        let tables: Vec<Tensor> = pieces
            .iter()
            .map(|p| Tensor::new(&p.blocks[..(p.start + p.len).div_ceil(bt)], &dev))
            .collect::<candle_core::Result<_>>()?;
        let rope = |x: &Tensor, heads: usize| -> candle_core::Result<Tensor> {
            // Each token its own batch row: `[n, heads, 1, head_dim]` against `[n, 1, hd/2]`.
            candle_nn::rotary_emb::rope(&x.reshape((n, heads, 1, hd))?, &cos, &sin)?
                .reshape((n, heads * hd))
        };
        let max_blocks = kv.config().max_blocks;
        let mut x = self.embed.forward(&Tensor::zeros(n, DType::U32, &dev)?)?;
        for (l, w) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &w.attn_norm, s.eps as f32)?;
            let q = rope(&w.wq.forward(&h)?, s.heads)?;
            let k = rope(&w.wk.forward(&h)?, s.kv_heads)?;
            let v = w.wv.forward(&h)?.contiguous()?;
            let kc = kv.k(l).map_err(candle_core::Error::wrap)?;
            let vc = kv.v(l).map_err(candle_core::Error::wrap)?;
            // The new tokens' K and V into their slots, in place (blocks the engine allocated).
            kc.reshape((max_blocks * bt, kvd))?
                .scatter_set(&rows, &k, 0)?;
            vc.reshape((max_blocks * bt, kvd))?
                .scatter_set(&rows, &v, 0)?;
            let mut outs = Vec::with_capacity(pieces.len());
            let mut off = 0;
            for (p, table) in pieces.iter().zip(&tables) {
                let q = q.narrow(0, off, p.len)?;
                off += p.len;
                outs.push(attend(s, &q, &kc, &vc, table, p.start, p.len)?);
            }
            let a = Tensor::cat(&outs, 0)?;
            x = (x + w.wo.forward(&a)?)?;
            let h = candle_nn::ops::rms_norm(&x, &w.mlp_norm, s.eps as f32)?;
            let m = (candle_nn::ops::silu(&w.gate.forward(&h)?)? * w.up.forward(&h)?)?;
            x = (x + w.down.forward(&m)?)?;
        }
        let x = x.index_select(&Tensor::new(last.as_slice(), &dev)?, 0)?;
        let x = candle_nn::ops::rms_norm(&x, &self.norm, s.eps as f32)?;
        self.lm_head.forward(&x)
    }
}

/// Attention of one sequence's `len` new queries `q` `[len, heads * head_dim]` (positions
/// `start..start + len`) over its context `0..start + len`, read from its blocks (`table`) of
/// the layer's cache tensors `[blocks, block_tokens, kv_heads, head_dim]`. Returns
/// `[len, heads * head_dim]`.
fn attend(
    s: &LlamaShape,
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    table: &Tensor,
    start: usize,
    len: usize,
) -> candle_core::Result<Tensor> {
    let (hd, kvh) = (s.head_dim(), s.kv_heads);
    let rep = s.heads / kvh;
    let ctx = start + len;
    let nb = table.dim(0)?;
    // [len, kvh, rep, hd] -> [kvh, rep * len, hd]
    let q = q
        .reshape((len, kvh, rep, hd))?
        .permute((1, 2, 0, 3))?
        .contiguous()?
        .reshape((kvh, rep * len, hd))?;
    let gather = |c: &Tensor| -> candle_core::Result<Tensor> {
        // [nb, bt, kvh, hd] -> [ctx, kvh, hd] -> [kvh, ctx, hd]
        c.index_select(table, 0)?
            .reshape((nb * BLOCK_TOKENS, kvh, hd))?
            .narrow(0, 0, ctx)?
            .transpose(0, 1)?
            .contiguous()
    };
    let (k, v) = (gather(kc)?, gather(vc)?);
    let scores = q
        .matmul(&k.t()?)?
        .to_dtype(DType::F32)?
        .affine(1.0 / (hd as f64).sqrt(), 0.0)?
        .reshape((kvh, rep, len, ctx))?;
    let scores = if len > 1 {
        // Query i (position start + i) sees keys 0..=start + i.
        let dev = q.device();
        let key = Tensor::arange(0u32, ctx as u32, dev)?.reshape((1, ctx))?;
        let query = Tensor::arange(start as u32, ctx as u32, dev)?.reshape((len, 1))?;
        let masked = key
            .broadcast_gt(&query)?
            .broadcast_as((kvh, rep, len, ctx))?;
        let neg = Tensor::new(f32::NEG_INFINITY, dev)?.broadcast_as((kvh, rep, len, ctx))?;
        masked.where_cond(&neg, &scores)?
    } else {
        scores
    };
    let p = candle_nn::ops::softmax_last_dim(&scores)?
        .to_dtype(DTYPE)?
        .reshape((kvh, rep * len, ctx))?;
    // [kvh, rep * len, hd] -> [len, kvh, rep, hd] -> [len, heads * hd]
    p.matmul(&v)?
        .reshape((kvh, rep, len, hd))?
        .permute((2, 0, 1, 3))?
        .contiguous()?
        .reshape((len, s.heads * hd))
}

/// One model's compute.
pub struct LlamaModel {
    handle: ModelHandle,
    llama: PagedLlama,
    kv: Arc<PagedKvTensors>,
    device: Device,
}

impl LlamaModel {
    fn run(&mut self, f: impl FnOnce(&mut Self) -> candle_core::Result<()>) -> Result<f64, String> {
        let t = Instant::now();
        let handle = self.handle.clone();
        route::with_route(&handle, Tag::Activations, || f(self))
            .map_err(|e| format!("route: {e}"))?
            .map_err(|e| e.to_string())?;
        self.device.synchronize().map_err(|e| e.to_string())?;
        Ok(t.elapsed().as_secs_f64())
    }
}

impl StepModel for LlamaModel {
    fn prefill(&mut self, seqs: &[SeqView]) -> Result<f64, String> {
        // Pieces of at most PREFILL_CHUNK tokens, packed into forwards of at most that many;
        // a sequence's later piece reads its earlier ones from the blocks (written first).
        let mut pieces = Vec::new();
        for s in seqs {
            let end = s.context as usize;
            let mut at = end - (s.new_tokens as usize).min(end);
            while at < end {
                let len = (end - at).min(PREFILL_CHUNK);
                pieces.push(Piece {
                    blocks: s.blocks,
                    start: at,
                    len,
                });
                at += len;
            }
        }
        self.run(|m| {
            let mut batch: Vec<Piece> = Vec::new();
            let mut tokens = 0;
            for p in pieces {
                if tokens + p.len > PREFILL_CHUNK && !batch.is_empty() {
                    m.llama.forward(&m.kv, &batch)?;
                    batch.clear();
                    tokens = 0;
                }
                tokens += p.len;
                batch.push(p);
            }
            if !batch.is_empty() {
                m.llama.forward(&m.kv, &batch)?;
            }
            Ok(())
        })
    }

    fn decode(&mut self, seqs: &[SeqView]) -> Result<f64, String> {
        let pieces: Vec<Piece> = seqs
            .iter()
            .map(|s| Piece {
                blocks: s.blocks,
                start: (s.context as usize).saturating_sub(1),
                len: 1,
            })
            .collect();
        self.run(|m| m.llama.forward(&m.kv, &pieces).map(|_| ()))
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
    /// Models the budget holds (bases and KV shares); fewer than `models` is the sleep
    /// policy's case (the models start asleep and wake on demand).
    pub resident: usize,
    /// KV bytes per model under `static` (the budget is the models' bases plus K of these).
    pub kv_share: u64,
    /// Engine limits.
    pub engine: EngineConfig,
    /// Pin host memory for each model's sleeps ahead (pinning costs about 0.6 s per GiB: off
    /// the sleep path, which the runs time).
    pub staging: bool,
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
    _ballast: ModelHandle,
}

/// Load `sizes.models` models with random weights on GPU 0, warm each (one prefill of the
/// longest step and one decode of the largest batch), and size the budget: every model's base
/// (weights and warm activations, with a margin) plus `kv_share` per model.
pub fn cluster(sizes: GpuSizes, progress: &dyn Fn(&str)) -> Result<GpuCluster, String> {
    let e = |e: elastic_vmm::Error| e.to_string();
    let ce = |e: candle_core::Error| e.to_string();
    let device = Device::new_cuda(0).map_err(ce)?;
    let backend = Arc::new(CudaBackend::new(0).map_err(e)?);
    // The budget is set once the bases are known; until then the device's free memory.
    let gpu = SharedPool::new(backend, SharedPoolConfig::new()).map_err(e)?;
    let device_budget = gpu.global_limit();
    let cfg = sizes.size.config();
    let mut loaded = Vec::new();
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
        let llama = route::with_route(&handle, Tag::Weights, || {
            let vb = VarBuilder::from_backend(Box::new(RandomWeights), DTYPE, device.clone());
            PagedLlama::load(cfg, vb)
        })
        .map_err(e)?
        .map_err(ce)?;
        device.synchronize().map_err(ce)?;
        // The f32 draws the weights were converted from go back to the device.
        handle.trim().map_err(e)?;
        let weights = handle.model_stats().map_or(0, |s| s.in_use);
        progress(&format!(
            "loaded {id}: {:.2} GiB of random weights on the device in {:.1} s",
            weights as f64 / (1u64 << 30) as f64,
            t.elapsed().as_secs_f64()
        ));
        let tensors = TensorPool::new(&handle, &device).map_err(e)?;
        // Room for every policy: the KV of all models together (address space only until
        // blocks are allocated).
        let per_block =
            (2 * cfg.layers * BLOCK_TOKENS * cfg.kv_heads * cfg.head_dim() * DTYPE.size_in_bytes())
                as u64;
        let max_blocks = (sizes.kv_share * sizes.models as u64 / per_block) as usize + 1;
        let kv = Arc::new(
            PagedKvTensors::new(
                &tensors,
                PagedKvConfig::new(
                    cfg.layers,
                    cfg.kv_heads,
                    cfg.head_dim(),
                    BLOCK_TOKENS,
                    DTYPE.size_in_bytes(),
                    max_blocks,
                ),
                DTYPE,
            )
            .map_err(e)?,
        );
        let block_bytes = paged_block_bytes(kv.cache());
        let model = LlamaModel {
            handle: handle.clone(),
            llama,
            kv: kv.clone(),
            device: device.clone(),
        };
        let pkv = PoolKv::new(
            kv,
            handle.clone(),
            max_blocks,
            BLOCK_TOKENS as u32,
            block_bytes,
        );
        loaded.push((handle, model, pkv, tensors, weights));
    }
    // Warm: the largest prefill and decode steps (on blocks allocated for them and freed
    // after), so each model's activations are at their peak once; the base is what it holds
    // then, with a quarter of the activations more as margin.
    let mut models = Vec::new();
    let mut tensor_pools = Vec::new();
    for (handle, mut model, pkv, tensors, weights) in loaded {
        let prompt = PREFILL_CHUNK as u32;
        let batch = sizes.engine.max_batch;
        let blocks = pkv
            .store
            .alloc(PREFILL_CHUNK / BLOCK_TOKENS + batch)
            .map_err(|e| format!("warm-up KV blocks of {}: {e}", handle.id()))?;
        let (long, short) = blocks.split_at(PREFILL_CHUNK / BLOCK_TOKENS);
        let warm = (|| {
            model.prefill(&[SeqView {
                blocks: long,
                new_tokens: prompt,
                context: prompt,
            }])?;
            let seqs: Vec<SeqView> = short
                .iter()
                .map(|b| SeqView {
                    blocks: std::slice::from_ref(b),
                    new_tokens: 1,
                    context: 1,
                })
                .collect();
            model.decode(&seqs).map(|_| ())
        })();
        pkv.store.free(&blocks)?;
        warm?;
        let st = handle.model_stats().ok_or("model gone")?;
        let weights_and_act = st.used;
        let base = weights_and_act + weights_and_act.saturating_sub(weights) / 4;
        progress(&format!(
            "warmed {}: {:.2} GiB with activations, base {:.2} GiB",
            handle.id(),
            weights_and_act as f64 / (1u64 << 30) as f64,
            base as f64 / (1u64 << 30) as f64
        ));
        if sizes.staging {
            let t = Instant::now();
            handle.reserve_host_staging(base).map_err(e)?;
            progress(&format!(
                "pinned {:.2} GiB of host staging for {}'s sleeps in {:.1} s",
                base as f64 / (1u64 << 30) as f64,
                handle.id(),
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
    let bases = models.iter().map(|m| m.base).sum::<u64>();
    let resident = sizes.resident.clamp(1, sizes.models) as u64;
    let budget = bases / sizes.models as u64 * resident + sizes.kv_share * resident;
    if budget > device_budget {
        return Err(format!(
            "the budget of {:.2} GiB (bases and {} x {:.2} GiB of KV) exceeds the device's {:.2} GiB: lower --kv-share-gib or --models",
            budget as f64 / (1u64 << 30) as f64,
            resident,
            sizes.kv_share as f64 / (1u64 << 30) as f64,
            device_budget as f64 / (1u64 << 30) as f64
        ));
    }
    if bases > budget {
        // More models than the budget holds: all of them asleep before the budget is set.
        device.synchronize().map_err(ce)?;
        for m in &models {
            m.handle
                .sleep(&crate::cluster::sleep_policy())
                .map_err(|e| format!("sleep {}: {e}", m.handle.id()))?;
        }
    }
    // The device's memory beyond the budget is held back by a model that only holds a
    // guarantee (nothing mapped): no policy can use it.
    let rest = device_budget - budget;
    let ballast = gpu
        .register(ModelConfig::new("held-back", 1 << 21, rest.max(1)).guarantee(rest))
        .map_err(e)?;
    Ok(GpuCluster {
        gpu,
        models,
        tensor_pools,
        device,
        budget,
        _ballast: ballast,
    })
}
