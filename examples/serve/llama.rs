//! The real models for the GPU: candle-transformers' Llama with random weights made on the
//! device inside the model's route (every weight byte is its pool's memory, tagged weights), its
//! KV blocks an `ElasticKv` of the model's pool (one 2 MiB page per block), every activation
//! routed into the model's pool.
//!
//! A step runs real kernels over real shapes: a prefill is one forward per sequence over its
//! new tokens (causal attention over them); a decode step one forward of the whole batch
//! (`[B, 1]`), then a read of every KV block the batch holds (a gather over the elastic tensor:
//! the attention's KV traffic, on memory that must be mapped). candle-transformers' Llama keeps
//! its own contiguous KV cache, which continuous batching cannot use, so the decode forward
//! runs without it and the gather stands in for the attention's reads; the paged KV cache
//! (its own issue) replaces this with real paged attention.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use candle_transformers::models::llama::{Cache, Config, Llama, LlamaConfig};
use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::candle::{ElasticKv, TensorPool};
use elastic_vmm::route;
use elastic_vmm::{MemOptions, ModelConfig, ModelHandle, SharedPool, SharedPoolConfig, Tag};

use crate::cluster::{BlockStore, PoolKv, Served};
use crate::engine::{Engine, EngineConfig, SeqView, StepModel};

const DTYPE: DType = DType::BF16;
/// Blocks of KV read per gather (bounds the gather's output: 64 pages).
const GATHER_BLOCKS: usize = 64;
/// Most tokens in one prefill forward: longer contexts (recomputed ones) go in pieces, which
/// bounds the attention's `[heads, n, n]` scores (0.5 GiB in f32 for the 8B shape).
pub const PREFILL_CHUNK: usize = 2048;

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

    /// candle-transformers' config.
    pub fn config(self) -> Config {
        let c = match self {
            Size::Small => LlamaConfig {
                hidden_size: 1024,
                intermediate_size: 2816,
                vocab_size: 32000,
                num_hidden_layers: 16,
                num_attention_heads: 16,
                num_key_value_heads: Some(8),
                rms_norm_eps: 1e-5,
                rope_theta: 10_000.0,
                bos_token_id: Some(1),
                eos_token_id: None,
                rope_scaling: None,
                max_position_embeddings: 4096,
                tie_word_embeddings: Some(false),
            },
            Size::Llama8B => LlamaConfig {
                hidden_size: 4096,
                intermediate_size: 14336,
                vocab_size: 128256,
                num_hidden_layers: 32,
                num_attention_heads: 32,
                num_key_value_heads: Some(8),
                rms_norm_eps: 1e-5,
                rope_theta: 500_000.0,
                bos_token_id: Some(128000),
                eos_token_id: None,
                rope_scaling: None,
                max_position_embeddings: 4096,
                tie_word_embeddings: Some(false),
            },
        };
        c.into_config(false)
    }

    /// KV elements per token (keys and values of every layer).
    pub fn kv_elems_per_token(self) -> usize {
        let c = self.config();
        let head_dim = c.hidden_size / c.num_attention_heads;
        2 * c.num_hidden_layers * c.num_key_value_heads * head_dim
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

/// One model's compute.
pub struct LlamaModel {
    handle: ModelHandle,
    llama: Llama,
    cache: Cache,
    config: Config,
    kv: Arc<ElasticKv>,
    device: Device,
}

impl LlamaModel {
    fn run<R>(
        &mut self,
        f: impl FnOnce(&mut Self) -> candle_core::Result<R>,
    ) -> Result<f64, String> {
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
        let lens: Vec<usize> = seqs.iter().map(|s| s.new_tokens as usize).collect();
        self.run(|m| {
            for &len in &lens {
                let mut left = len;
                while left > 0 {
                    let n = left.min(PREFILL_CHUNK);
                    left -= n;
                    // A fresh cache: its causal masks are per length and would pile up.
                    let mut cache = Cache::new(false, DTYPE, &m.config, &m.device)?;
                    let ids = Tensor::zeros((1, n), DType::U32, &m.device)?;
                    m.llama.forward(&ids, 0, &mut cache)?;
                }
            }
            Ok(())
        })
    }

    fn decode(&mut self, seqs: &[SeqView]) -> Result<f64, String> {
        let b = seqs.len();
        let blocks: Vec<usize> = seqs
            .iter()
            .flat_map(|s| s.blocks.iter().map(|&i| i as usize))
            .collect();
        self.run(|m| {
            let ids = Tensor::zeros((b, 1), DType::U32, &m.device)?;
            m.llama.forward(&ids, 0, &mut m.cache)?;
            for chunk in blocks.chunks(GATHER_BLOCKS) {
                m.kv.gather(chunk)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            }
            Ok(())
        })
    }
}

impl BlockStore for Arc<ElasticKv> {
    fn back(&self, ids: &[u32]) -> Result<(), String> {
        self.ensure_backed(ids.iter().map(|&i| i as usize))
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
    fn unback(&self, ids: &[u32]) -> Result<(), String> {
        self.release(ids.iter().map(|&i| i as usize))
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// The cluster's models on the GPU.
pub type GpuServed = Served<Arc<ElasticKv>, LlamaModel>;

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
    /// Per model tensor pools (the elastic KV tensors' home).
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
    let elems = sizes.size.kv_elems_per_token();
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
        let (llama, cache) = route::with_route(&handle, Tag::Weights, || {
            let vb = VarBuilder::from_backend(Box::new(RandomWeights), DTYPE, device.clone());
            let llama = Llama::load(vb, &cfg)?;
            let cache = Cache::new(false, DTYPE, &cfg, &device)?;
            Ok::<_, candle_core::Error>((llama, cache))
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
        let page = tensors.pool().granularity();
        let per_token = (elems * DTYPE.size_in_bytes()) as u64;
        if page % per_token != 0 {
            return Err(format!(
                "a {page}-byte page does not hold whole tokens of {per_token} KV bytes"
            ));
        }
        let block_tokens = (page / per_token) as u32;
        // Room for every policy: the KV of all models together.
        let max_blocks = (sizes.kv_share * sizes.models as u64 / page) as usize + 1;
        let kv = Arc::new(
            ElasticKv::new(
                &tensors,
                max_blocks,
                &[block_tokens as usize, elems],
                DTYPE,
                &MemOptions::new(),
            )
            .map_err(e)?,
        );
        let model = LlamaModel {
            handle: handle.clone(),
            llama,
            cache,
            config: cfg.clone(),
            kv: kv.clone(),
            device: device.clone(),
        };
        let pkv = PoolKv::new(kv, handle.clone(), max_blocks, block_tokens, page);
        loaded.push((handle, model, pkv, tensors, weights));
    }
    // Warm: the largest prefill and decode steps, so each model's activations are at their
    // peak once; the base is what it holds then, with a quarter of the activations more as
    // margin.
    let mut models = Vec::new();
    let mut tensor_pools = Vec::new();
    for (handle, mut model, pkv, tensors, weights) in loaded {
        let prompt = PREFILL_CHUNK as u32;
        let blocks: Vec<u32> = Vec::new();
        model.prefill(&[SeqView {
            blocks: &blocks,
            new_tokens: prompt,
            context: prompt,
        }])?;
        let batch: Vec<SeqView> = (0..sizes.engine.max_batch)
            .map(|_| SeqView {
                blocks: &blocks,
                new_tokens: 1,
                context: 1,
            })
            .collect();
        model.decode(&batch)?;
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
