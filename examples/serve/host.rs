//! The benchmark on the host backend: models whose weights, activations and KV blocks are real
//! memory of one shared pool (memfd chunks), compute modelled by [`SimCost`]. Used by the host
//! tests and by `serve --sim` (the whole sweep without a GPU, to check the driver). Sleeps go
//! through one host tier all models share (page-locked host memory: `HostBackend::locked`, as
//! `Pool::host_tier` falls back to), as on the GPU.

use std::sync::Arc;

use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::kv::{KvLayout, PagedKv, PagedKvConfig};
use elastic_vmm::{
    Allocation, MemOptions, ModelConfig, Pool, PoolConfig, SharedPool, SharedPoolConfig, Tag,
};

use crate::cluster::{paged_block_bytes, PoolKv, Served};
use crate::engine::{Engine, EngineConfig, SeqView, SimCost, StepModel};

/// A simulated model over real memory: its weights are an allocation with a known pattern (a
/// sleep must bring them back intact), each step allocates (and frees) its activations in the
/// model's pool, so a step that cannot get its memory fails like an out-of-memory would. With
/// `wall` set a step also takes its modelled time in wall-clock time (it sleeps), as a real
/// model's forward would; the virtual-clock driver leaves it off.
pub struct SimModel {
    /// The model's pool (a shared pool's model, or a model on the broker).
    pub pool: Pool,
    /// Step costs.
    pub cost: SimCost,
    /// Activation bytes per token of a step.
    pub act_bytes_per_token: u64,
    /// The weights, filled with `pattern`.
    pub weights: Allocation,
    /// The weights' byte.
    pub pattern: u8,
    /// Whether a step sleeps for its modelled time.
    pub wall: bool,
    /// With `wall`: a file every engine of the run opened, locked for the length of each step
    /// (engines taking turns on one simulated device).
    pub device: Option<std::fs::File>,
}

impl SimModel {
    /// Whether the weights still hold their pattern (first and last bytes of every page).
    pub fn weights_intact(&self) -> Result<bool, String> {
        let size = self.weights.size();
        let mut b = [0u8; 1];
        for at in (0..size).step_by(4096).chain([size - 1]) {
            self.weights.read(at, &mut b).map_err(|e| e.to_string())?;
            if b[0] != self.pattern {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn activations(&self, tokens: u64) -> Result<(), String> {
        let bytes = (tokens * self.act_bytes_per_token).max(1) as usize;
        let mut a = self
            .pool
            .allocate_with(bytes, &MemOptions::new().tag(Tag::Activations))
            .map_err(|e| format!("activations of {bytes} bytes: {e}"))?;
        a.write(0, &[1]).map_err(|e| e.to_string())?;
        Ok(())
    }
}

impl SimModel {
    fn took(&self, dt: f64) -> f64 {
        if !self.wall {
            return dt;
        }
        let fd = self.device.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
        if let Some(fd) = fd {
            // SAFETY: `fd` is an open file of ours for the call's duration.
            while unsafe { libc::flock(fd, libc::LOCK_EX) } != 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    // Not expected: the step runs unshared, and says so.
                    eprintln!("serve: the simulated device's lock failed ({e}); this step runs beside the others");
                    break;
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_secs_f64(dt));
        if let Some(fd) = fd {
            // SAFETY: as above.
            unsafe { libc::flock(fd, libc::LOCK_UN) };
        }
        dt
    }
}

impl StepModel for SimModel {
    fn prefill(&mut self, seqs: &[SeqView]) -> Result<f64, String> {
        self.activations(seqs.iter().map(|s| s.new_tokens as u64).sum())?;
        let dt = self.cost.prefill(seqs)?;
        Ok(self.took(dt))
    }
    fn decode(&mut self, seqs: &[SeqView]) -> Result<f64, String> {
        self.activations(seqs.len() as u64)?;
        let dt = self.cost.decode(seqs)?;
        Ok(self.took(dt))
    }
}

/// Sizes of a host cluster.
#[derive(Debug, Clone, Copy)]
pub struct HostSizes {
    /// Models.
    pub models: usize,
    /// Models whose weights, activations and KV share the budget holds (fewer than `models`:
    /// only the sleep policy serves them all).
    pub resident: usize,
    /// Weights per model (bytes).
    pub weights: u64,
    /// Activation bytes per token of a step.
    pub act_bytes_per_token: u64,
    /// Activation bytes reserved per model (guaranteed with the weights).
    pub act_reserve: u64,
    /// KV blocks of all models together.
    pub kv_blocks: u64,
    /// Tokens per KV block (a block is one granule: its K and V of [`HOST_KV_LAYERS`] layers).
    pub block_tokens: u32,
    /// The host backend's granularity (bytes of a block).
    pub granularity: u64,
    /// Engine limits.
    pub engine: EngineConfig,
    /// Step costs.
    pub cost: SimCost,
}

impl HostSizes {
    /// Small enough for CI: 64 KiB granules of 16 tokens, 1 MiB of weights per model (a
    /// sleeping model's copy is page-locked host memory: a few of them stay under an 8 MiB
    /// `RLIMIT_MEMLOCK`).
    pub fn tiny(models: usize, kv_blocks: u64) -> Self {
        HostSizes {
            models,
            resident: models,
            weights: 1 << 20,
            act_bytes_per_token: 256,
            act_reserve: 1 << 20,
            kv_blocks,
            block_tokens: 16,
            granularity: 64 << 10,
            engine: EngineConfig {
                max_batch: 32,
                max_prefill_tokens: 2048,
                max_context: 4096,
            },
            cost: SimCost::small(),
        }
    }
}

/// A model of a host cluster.
pub type HostServed = Served<PagedKv, SimModel>;

/// Layers of a host model's KV cache (its shape only sizes the blocks).
pub const HOST_KV_LAYERS: usize = 2;
/// KV heads of a host model's KV cache.
pub const HOST_KV_HEADS: usize = 4;
/// Bytes per KV element (bf16).
const HOST_ELEM_BYTES: usize = 2;

/// The paged KV cache of a host model: blocks of `block_tokens` tokens laid out contiguously
/// (`[blocks, layers, 2, block_tokens, heads, head_dim]`), the head dimension chosen so one
/// block is exactly one granule of `granularity` bytes (the budget counts blocks in granules).
pub fn kv_config(
    blocks: usize,
    block_tokens: u32,
    granularity: u64,
) -> Result<PagedKvConfig, String> {
    let per_dim =
        (HOST_KV_LAYERS * 2 * block_tokens as usize * HOST_KV_HEADS * HOST_ELEM_BYTES) as u64;
    if block_tokens == 0 || granularity % per_dim != 0 {
        return Err(format!(
            "a {granularity}-byte block does not hold {block_tokens} tokens of {HOST_KV_LAYERS} layers x {HOST_KV_HEADS} heads in whole dimensions of {per_dim} bytes"
        ));
    }
    Ok(PagedKvConfig::new(
        HOST_KV_LAYERS,
        HOST_KV_HEADS,
        (granularity / per_dim) as usize,
        block_tokens as usize,
        HOST_ELEM_BYTES,
        blocks,
    )
    .layout(KvLayout::Contiguous))
}

/// A shared host tier of page-locked host memory (granules of `granularity` bytes, at most
/// `capacity` bytes) for models' sleeps.
pub fn host_tier(granularity: u64, capacity: u64) -> Result<Pool, String> {
    let e = |e: elastic_vmm::Error| e.to_string();
    let backend = HostBackend::locked(granularity as usize).map_err(e)?;
    Pool::new(
        Arc::new(backend),
        PoolConfig::new(capacity as usize).name("host-tier"),
    )
    .map_err(e)
}

/// A shared pool on the host backend with `sizes.models` simulated models loaded, their
/// sleeps staged through the returned host tier.
pub fn cluster(sizes: HostSizes) -> Result<(SharedPool, Vec<HostServed>, Pool), String> {
    let e = |e: elastic_vmm::Error| e.to_string();
    let g = sizes.granularity;
    // A model's base: weights, activations and its KV cache's zero page (one granule under the
    // cache's unbacked pages, charged to the model).
    let base = sizes.weights + sizes.act_reserve + g;
    let budget = base * sizes.resident as u64 + sizes.kv_blocks * g;
    let backend = Arc::new(HostBackend::new(g as usize).map_err(e)?);
    let gpu = SharedPool::new(backend, SharedPoolConfig::new().global_limit(budget)).map_err(e)?;
    let tier = host_tier(g, base * sizes.models as u64 + (16 << 20))?;
    let mut models = Vec::new();
    for i in 0..sizes.models {
        let id = format!("sim-{i}");
        let virt = (2 * budget + (64 << 20)) as usize;
        let handle = gpu
            .register(ModelConfig::new(&id, virt, budget))
            .map_err(e)?;
        handle.stage_through(Some(tier.clone())).map_err(e)?;
        let mut weights = handle
            .allocate_with(sizes.weights as usize, &MemOptions::new().tag(Tag::Weights))
            .map_err(e)?;
        let pattern = 0x5A ^ i as u8;
        weights.fill(pattern).map_err(e)?;
        let store = PagedKv::new(
            &handle,
            kv_config(sizes.kv_blocks as usize, sizes.block_tokens, g)?,
        )
        .map_err(e)?;
        if store.block_span_bytes() != g {
            return Err(format!(
                "a KV block spans {} bytes, not one {g}-byte granule",
                store.block_span_bytes()
            ));
        }
        let block_bytes = paged_block_bytes(&store);
        let kv = PoolKv::new(
            store,
            handle.clone(),
            sizes.kv_blocks as usize,
            sizes.block_tokens,
            block_bytes,
        );
        let model = SimModel {
            pool: handle.pool().clone(),
            cost: sizes.cost,
            act_bytes_per_token: sizes.act_bytes_per_token,
            weights,
            pattern,
            wall: false,
            device: None,
        };
        models.push(Served {
            handle,
            engine: Engine::new(kv, model, sizes.engine),
            base,
            guarantee: 0,
        });
    }
    Ok((gpu, models, tier))
}
