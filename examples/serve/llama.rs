//! The real models for the GPU: a Llama-shaped decoder built from candle-nn pieces (RMS norm,
//! rotary embeddings, grouped-query attention, SwiGLU MLP) with random weights made on the device
//! inside the model's route (every weight byte is its pool's memory, tagged weights), its KV in
//! a paged KV cache of the model's pool ([`PagedKvTensors`]: per layer a K and a V tensor
//! `[blocks, block_tokens, kv_heads, head_dim]`), every activation routed into the model's pool.
//!
//! A step runs real kernels over real shapes, as a paged-attention engine does (see
//! `paged_llama.rs`): projections and MLP batched over every token of the step, each token's K
//! and V written into its sequence's blocks, attention over each sequence's blocks gathered by
//! its block table (a decode step in one batch). A prefill goes in forwards of at most [`PREFILL_CHUNK`] tokens (a longer
//! context, e.g. a recomputed one, in pieces; a piece reads the earlier ones from the blocks).

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::candle::{PagedKvTensors, TensorPool};
use elastic_vmm::kv::PagedKvConfig;
use elastic_vmm::route;
use elastic_vmm::{ModelConfig, ModelHandle, SharedPool, SharedPoolConfig, Tag};

use crate::cluster::{paged_block_bytes, paged_bytes_for, BlockStore, PoolKv, Served};
use crate::engine::{Engine, EngineConfig, SeqView, StepModel};
pub use crate::paged_llama::PREFILL_CHUNK;
use crate::paged_llama::{LayerCache, LlamaShape, PagedLlama, Piece, BLOCK_TOKENS};

const DTYPE: DType = DType::BF16;

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
        // Detached: a tensor made from a `Var` keeps its op graph (the f32 draw) alive for
        // backprop, which left the draws in use beside the weights (3x the weights' bytes).
        Ok(h.var(s, DType::F32, dev)?
            .as_tensor()
            .to_dtype(dtype)?
            .detach())
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
                    m.llama.forward(&*m.kv, &batch)?;
                    batch.clear();
                    tokens = 0;
                }
                tokens += p.len;
                batch.push(p);
            }
            if !batch.is_empty() {
                m.llama.forward(&*m.kv, &batch)?;
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
        self.run(|m| m.llama.forward(&*m.kv, &pieces).map(|_| ()))
    }
}

impl LayerCache for PagedKvTensors {
    fn layer(&self, l: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let e = candle_core::Error::wrap;
        Ok((self.k(l).map_err(e)?, self.v(l).map_err(e)?))
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
