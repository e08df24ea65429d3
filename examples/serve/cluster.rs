//! K models of one [`SharedPool`] serving one trace under a memory policy.
//!
//! Time is virtual and advanced by what the models' steps take (measured on the GPU, modelled
//! by a simulated model): the models share one device, so their steps run one after the other,
//! round-robin among the models with work; while no model has work the clock jumps to the next
//! arrival (a trace at low load replays in less than its duration). Sleep and wake take their
//! measured wall time.
//!
//! Policies (the same engine, trace and device):
//! - `static`: each model's limit is its weights and activations plus 1/K of the KV budget, all
//!   of it guaranteed (a fixed reservation, as `--gpu-memory-utilization` makes);
//! - `elastic`: one budget; each model is guaranteed its weights and activations, and its KV
//!   grows into whatever the others do not hold. A model holds more than its fair share (1/K of
//!   the KV budget) only while no other model waits for memory: once one's next request cannot
//!   get its blocks, the others admit nothing more while over their share (running requests
//!   finish, nothing is preempted across models);
//! - `sleep`: `elastic`, and a model idle for `idle_s` sleeps (weights and activations
//!   offloaded to host memory, KV discarded, its guarantee dropped to 0); a request for it
//!   wakes it, preempting other models' requests when its memory is held.

use std::cell::Cell;
use std::time::Instant;

use elastic_vmm::kv::PagedKv;
use elastic_vmm::{AfterWake, ModelHandle, SharedPool, SleepAction, SleepPolicy, Tag};
use serde::{Deserialize, Serialize};

use crate::engine::{Engine, EngineCounters, KvBlocks, StepModel};
use crate::trace::Trace;

/// Failed steps in a row after which a run stops (a failed step takes no time).
const MAX_FAILED_STEPS: u32 = 100;

/// A memory policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Policy {
    /// Fixed 1/K partitions.
    Static,
    /// One shared budget.
    Elastic,
    /// One shared budget; models idle this long (seconds) sleep.
    Sleep {
        /// Idle seconds before a model sleeps.
        idle_s: f64,
    },
}

impl Policy {
    /// Short name.
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Static => "static",
            Policy::Elastic => "elastic",
            Policy::Sleep { .. } => "sleep",
        }
    }
}

/// Where a pool-backed KV cache gets its blocks: a [`PagedKv`] of the model's pool (host), or
/// its candle face `PagedKvTensors` (GPU). Block ids index the first dimension of its tensors.
pub trait BlockStore {
    /// `n` blocks, mapped when this returns; all or nothing.
    fn alloc(&self, n: usize) -> Result<Vec<u32>, String>;
    /// Give `ids` back (their pages go back to the pool when no other block touches them).
    fn free(&self, ids: &[u32]) -> Result<(), String>;
    /// Blocks the cache could hand out now without reclaiming anything (the pool's free
    /// budget under the model's limit).
    fn available(&self) -> usize;
    /// Bytes `blocks` live blocks hold, packed: whole groups of blocks that share their pages
    /// (the cache hands out blocks on pages mapped already first). More once freed blocks
    /// scatter the live ones over more pages.
    fn bytes_for(&self, blocks: usize) -> u64;
    /// Give warm blocks (freed, kept mapped for reuse) back to the pool.
    fn trim(&self);
}

/// [`BlockStore::bytes_for`] of a [`PagedKv`]: a group of `page / span` blocks (at least one)
/// costs a page's worth of its span in every tensor (the rule of `PagedKv::available`).
pub fn paged_bytes_for(kv: &PagedKv, blocks: usize) -> u64 {
    let page = kv.pool().granularity();
    let span = kv.block_span_bytes().max(1);
    let per_group = (page / span).max(1);
    let group = kv.tensors() as u64 * span.div_ceil(page) * page;
    (blocks as u64).div_ceil(per_group) * group
}

/// The memory one block of `kv` costs on average (a group's bytes over its blocks).
pub fn paged_block_bytes(kv: &PagedKv) -> u64 {
    let page = kv.pool().granularity();
    let per_group = (page / kv.block_span_bytes().max(1)).max(1);
    (paged_bytes_for(kv, per_group as usize) / per_group).max(1)
}

impl BlockStore for PagedKv {
    fn alloc(&self, n: usize) -> Result<Vec<u32>, String> {
        let ids = PagedKv::alloc(self, n).map_err(|e| e.to_string())?;
        Ok(ids.into_iter().map(|i| i as u32).collect())
    }
    fn free(&self, ids: &[u32]) -> Result<(), String> {
        let ids: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
        PagedKv::free(self, &ids).map_err(|e| e.to_string())
    }
    fn available(&self) -> usize {
        PagedKv::available(self)
    }
    fn bytes_for(&self, blocks: usize) -> u64 {
        paged_bytes_for(self, blocks)
    }
    fn trim(&self) {
        PagedKv::trim(self);
    }
}

/// Bytes of KV `model` can take now: its limit, and the global budget less what every other
/// model uses or was guaranteed, beyond what it needs itself: its `base` (weights and
/// activations, in use or not) and the `kv` bytes it holds.
pub fn kv_headroom(model: &ModelHandle, base: u64, kv: u64) -> u64 {
    let st = model.shared().stats();
    let Some(me) = st.models.iter().find(|m| m.id == model.id()) else {
        return 0;
    };
    // In use counts allocations whose memory sleeps (uncharged): not a claim on the budget.
    let awake_use =
        |m: &elastic_vmm::shared::ModelStats| (m.in_use + m.in_flight).saturating_sub(m.asleep);
    let mine = awake_use(me).max(base + kv);
    let others: u64 = st
        .models
        .iter()
        .filter(|m| m.id != model.id())
        .map(|m| awake_use(m).max(m.guarantee))
        .sum();
    me.limit
        .min(st.global.limit.saturating_sub(others))
        .saturating_sub(mine)
}

/// A KV cache of pool memory: the engine's face of a [`BlockStore`] (a paged KV cache), blocks
/// mapped when allocated and unmapped when freed, every byte charged to its model under the
/// shared budget. Admission takes the least of the cache's own `available()`, the policy's caps
/// and [`kv_headroom`] (which also counts what other models were guaranteed).
///
/// Under the elastic policies (`reserve`) the model's guarantee follows its KV: `base` plus the
/// blocks it holds, raised before blocks are mapped and lowered after they are unmapped. Then
/// no model's KV can take the memory another model's next step needs for its activations (a
/// fixed guarantee of `base` would stop protecting them once the model's KV passed it).
pub struct PoolKv<S: BlockStore> {
    /// The blocks' memory.
    pub store: S,
    model: ModelHandle,
    block_tokens: u32,
    block_bytes: u64,
    held: usize,
    total: usize,
    /// Blocks the policy lets it hold (allocations beyond are refused).
    pub cap: usize,
    /// Blocks it may hold after admitting a request (the elastic fair share while another
    /// model waits; decode growth of admitted requests is not held to it).
    pub admit_cap: usize,
    /// Blocks the policy could ever let it hold.
    pub max_cap: usize,
    /// Releases that failed (must stay 0).
    pub release_errors: u64,
    /// Weights and activations of the model (bytes).
    pub base: u64,
    /// Whether its guarantee follows its KV (elastic policies).
    pub reserve: bool,
    /// The guarantee it set last (`u64::MAX`: not known, set by someone else since).
    guaranteed: Cell<u64>,
    /// Calls into the shared pool's budget (guarantee changes) it made.
    pub budget_calls: Cell<u64>,
}

impl<S: BlockStore> PoolKv<S> {
    /// `total` blocks of `block_tokens` tokens, `block_bytes` each (the memory one block costs
    /// on average: its span in every tensor), in `store` of `model`.
    pub fn new(
        store: S,
        model: ModelHandle,
        total: usize,
        block_tokens: u32,
        block_bytes: u64,
    ) -> Self {
        PoolKv {
            store,
            model,
            block_tokens,
            block_bytes,
            held: 0,
            total,
            cap: total,
            admit_cap: total,
            max_cap: total,
            release_errors: 0,
            base: 0,
            reserve: false,
            guaranteed: Cell::new(u64::MAX),
            budget_calls: Cell::new(0),
        }
    }

    /// The model's guarantee was set elsewhere (policy change, sleep, wake): the next change
    /// goes to the budget even if it looks like the last one made here.
    pub fn forget_guarantee(&self) {
        self.guaranteed.set(u64::MAX);
    }

    fn kv_bytes(&self, blocks: usize) -> u64 {
        self.store.bytes_for(blocks)
    }

    /// Set the model's guarantee to its base and `blocks` of KV. Only a change goes to the
    /// budget: blocks share pages, so most allocations and frees leave the bytes as they were
    /// (a budget call per block would be the elastic policy's overhead on the token path).
    fn guarantee(&self, blocks: usize) -> Result<(), String> {
        let g = self.base + self.kv_bytes(blocks);
        if g == self.guaranteed.get() {
            return Ok(());
        }
        self.budget_calls.set(self.budget_calls.get() + 1);
        self.guaranteed.set(u64::MAX);
        self.model
            .shared()
            .set_guarantee(self.model.id(), g)
            .map(|_| self.guaranteed.set(g))
            .map_err(|e| e.to_string())
    }

    /// Bytes per block.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// Blocks it could have now by its hard cap and the memory left (not the fair share).
    pub fn memory_available(&self) -> usize {
        let by_cap = self.cap.saturating_sub(self.used());
        let kv = self.kv_bytes(self.used());
        let by_memory = (kv_headroom(&self.model, self.base, kv) / self.block_bytes) as usize;
        let free = self.total - self.held;
        free.min(by_cap).min(by_memory).min(self.store.available())
    }
}

impl<S: BlockStore> KvBlocks for PoolKv<S> {
    fn block_tokens(&self) -> u32 {
        self.block_tokens
    }
    fn available(&mut self) -> usize {
        let by_cap = self.admit_cap.saturating_sub(self.used());
        self.memory_available().min(by_cap)
    }
    fn capacity(&self) -> usize {
        self.max_cap.min(self.total)
    }
    fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.held + n > self.total || self.held + n > self.cap {
            return None;
        }
        let held = self.held;
        if self.reserve {
            if let Err(e) = self.guarantee(held + n) {
                tracing::debug!(model = self.model.id(), n, error = %e, "KV guarantee refused");
                return None;
            }
        }
        match self.store.alloc(n) {
            Ok(ids) => {
                self.held += ids.len();
                Some(ids)
            }
            Err(e) => {
                tracing::debug!(model = self.model.id(), n, error = %e, "KV blocks refused");
                if self.reserve {
                    // Lowering a guarantee cannot fail.
                    let _ = self.guarantee(held);
                }
                None
            }
        }
    }
    fn free(&mut self, ids: &[u32]) {
        if ids.is_empty() {
            return;
        }
        match self.store.free(ids) {
            Ok(()) => self.held -= ids.len(),
            Err(e) => {
                // A bad id frees nothing: the books stay as the cache has them.
                tracing::error!(model = self.model.id(), error = %e, "KV release failed");
                self.release_errors += 1;
            }
        }
        if self.reserve {
            if let Err(e) = self.guarantee(self.used()) {
                tracing::error!(model = self.model.id(), error = %e, "lowering the KV guarantee failed");
            }
        }
    }
    fn used(&self) -> usize {
        self.held
    }
}

/// One model of the cluster.
pub struct Served<S: BlockStore, M: StepModel> {
    /// Its handle in the shared pool.
    pub handle: ModelHandle,
    /// Its engine.
    pub engine: Engine<PoolKv<S>, M>,
    /// Bytes of weights and activations (guaranteed under the elastic policies).
    pub base: u64,
    /// Its guarantee under the policy in force.
    pub guarantee: u64,
}

/// Run options.
#[derive(Debug, Clone, Copy)]
pub struct RunOptions {
    /// Stop this many seconds after the trace ends (requests unfinished then are counted).
    pub drain_s: f64,
    /// Memory sampling period (seconds of virtual time).
    pub sample_s: f64,
    /// The budget all models share (bytes): the shared pool's global limit, or less where
    /// the rest of it is held back (a guarantee of a model that holds nothing).
    pub budget: u64,
}

/// Per model results of one run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ModelSummary {
    /// Model id (or "all").
    pub id: String,
    /// Requests in the trace.
    pub requests: u64,
    /// Finished.
    pub finished: u64,
    /// Unfinished at the end of the run.
    pub unfinished: u64,
    /// Refused (could never fit).
    pub refused: u64,
    /// Time to first token, median and 99th percentile (seconds), over finished requests.
    pub ttft_p50: f64,
    /// 99th percentile TTFT.
    pub ttft_p99: f64,
    /// Mean TTFT.
    pub ttft_mean: f64,
    /// Time per output token, median (seconds).
    pub tpot_p50: f64,
    /// TPOT 99th percentile.
    pub tpot_p99: f64,
    /// Mean time per output token, weighted by tokens: all finished requests' decode time
    /// over their decoded tokens (steadier than a median over few requests).
    #[serde(default)]
    pub tpot_mean: f64,
    /// Output tokens per second of the run.
    pub throughput: f64,
    /// Preemptions.
    pub preemptions: u64,
    /// Failed steps (out of memory): must be 0.
    pub oom: u64,
    /// Peak physical bytes.
    pub peak_bytes: u64,
    /// Mean physical bytes (time-weighted samples).
    pub mean_bytes: f64,
    /// Mean bytes the policy holds for the model (time-weighted): the most of its physical
    /// use and its guarantee (memory no other model can have meanwhile; a static partition
    /// holds all of it).
    #[serde(default)]
    pub mean_held_bytes: f64,
    /// Steps run (prefill and decode).
    #[serde(default)]
    pub steps: u64,
    /// Sequences in decode steps over decode steps (mean decode batch).
    #[serde(default)]
    pub decode_batch: f64,
    /// Driver calls the model's pool made during the run (mappings, releases; sleeps and
    /// wakes included).
    #[serde(default)]
    pub driver_calls: u64,
    /// Calls into the shared budget its KV made (guarantee changes).
    #[serde(default)]
    pub budget_calls: u64,
    /// Sleeps, wakes and seconds spent waking.
    pub sleeps: u64,
    /// Wakes.
    pub wakes: u64,
    /// Seconds spent waking.
    pub wake_s: f64,
}

/// One run's results.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSummary {
    /// Label (model size and load point).
    pub label: String,
    /// Policy.
    pub policy: Policy,
    /// The trace's peak rate per model.
    pub peak_rate: f64,
    /// Trace duration (seconds).
    pub duration_s: f64,
    /// Virtual time the run took (seconds).
    pub span_s: f64,
    /// Wall time the run took (seconds).
    pub wall_s: f64,
    /// Global budget (bytes).
    pub budget: u64,
    /// KV budget (bytes).
    pub kv_budget: u64,
    /// Per model.
    pub models: Vec<ModelSummary>,
    /// All models together.
    pub overall: ModelSummary,
    /// Memory per model over time: (t, bytes per model).
    pub timeline: Vec<(f64, Vec<u64>)>,
    /// Errors seen (first few).
    pub errors: Vec<String>,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i.min(v.len() - 1)]
}

#[derive(Default)]
struct Tally {
    ttft: Vec<f64>,
    tpot: Vec<f64>,
    decode_s: f64,
    decoded: u64,
    held_integral: f64,
    driver_calls: u64,
    budget_calls: u64,
    requests: u64,
    unfinished: u64,
    counters: EngineCounters,
    peak: u64,
    mem_integral: f64,
    sleeps: u64,
    wakes: u64,
    wake_s: f64,
}

impl Tally {
    fn summary(&mut self, id: &str, span: f64) -> ModelSummary {
        let finished = self.ttft.len() as u64;
        let ttft_mean = if finished > 0 {
            self.ttft.iter().sum::<f64>() / finished as f64
        } else {
            f64::NAN
        };
        ModelSummary {
            id: id.to_string(),
            requests: self.requests,
            finished,
            unfinished: self.unfinished,
            refused: self.counters.refused,
            ttft_p50: percentile(&mut self.ttft, 0.5),
            ttft_p99: percentile(&mut self.ttft, 0.99),
            ttft_mean,
            tpot_p50: percentile(&mut self.tpot, 0.5),
            tpot_p99: percentile(&mut self.tpot, 0.99),
            tpot_mean: if self.decoded > 0 {
                self.decode_s / self.decoded as f64
            } else {
                f64::NAN
            },
            throughput: self.counters.tokens as f64 / span.max(1e-9),
            preemptions: self.counters.preemptions,
            oom: self.counters.oom,
            peak_bytes: self.peak,
            mean_bytes: self.mem_integral / span.max(1e-9),
            mean_held_bytes: self.held_integral / span.max(1e-9),
            steps: self.counters.prefills + self.counters.decodes,
            decode_batch: if self.counters.decodes > 0 {
                self.counters.decode_seqs as f64 / self.counters.decodes as f64
            } else {
                0.0
            },
            driver_calls: self.driver_calls,
            budget_calls: self.budget_calls,
            sleeps: self.sleeps,
            wakes: self.wakes,
            wake_s: self.wake_s,
        }
    }
}

/// After a wake the host copy goes back to where it came from (the shared host tier's cache,
/// where the next model's sleep finds it): host memory is held only for the models asleep.
pub const AFTER_WAKE: AfterWake = AfterWake::FreeHostMemory;

/// The sleep policy: weights and activations offloaded, KV discarded.
pub fn sleep_policy() -> SleepPolicy {
    SleepPolicy::offload_all().tag(Tag::Kv, SleepAction::Discard)
}

/// Put model `m` to sleep (weights and activations offloaded, KV discarded, its guarantee
/// dropped). Returns the seconds it took.
fn put_to_sleep<S: BlockStore, M: StepModel>(
    gpu: &SharedPool,
    m: &Served<S, M>,
    sync: &dyn Fn() -> Result<(), String>,
) -> Result<f64, String> {
    sync()?;
    let t = Instant::now();
    m.engine.kv.forget_guarantee();
    gpu.set_guarantee(m.handle.id(), 0)
        .map_err(|e| e.to_string())?;
    m.handle
        .sleep(&sleep_policy())
        .map_err(|e| format!("sleep {}: {e}", m.handle.id()))?;
    Ok(t.elapsed().as_secs_f64())
}

/// Set every model's limit, guarantee and KV cap for `policy` under `budget` bytes, and its
/// starting state: `static` and `elastic` keep every model resident (an error if their weights
/// and activations do not fit); `sleep` starts with every model awake when they all fit, else
/// with the first models whose bases leave a quarter of the budget awake and the others
/// asleep (more models than fit: they wake on demand). Returns the KV budget
/// (what the resident models' bases leave).
pub fn apply_policy<S: BlockStore, M: StepModel>(
    gpu: &SharedPool,
    models: &mut [Served<S, M>],
    policy: Policy,
    budget: u64,
    sync: &dyn Fn() -> Result<(), String>,
) -> Result<u64, String> {
    let k = models.len() as u64;
    let bases: u64 = models.iter().map(|m| m.base).sum();
    // What models outside this run hold (a sleeping model keeps its KV cache's zero page) is
    // no part of the budget this run shares.
    let others: u64 = gpu
        .stats()
        .models
        .iter()
        .filter(|s| !models.iter().any(|m| m.handle.id() == s.id))
        .map(|s| s.used)
        .sum();
    let budget = budget.saturating_sub(others);
    // Lower every guarantee first (a raised guarantee must fit beside the others').
    for m in models.iter() {
        m.engine.kv.forget_guarantee();
        gpu.set_guarantee(m.handle.id(), 0)
            .map_err(|e| e.to_string())?;
    }
    // Every run starts from the same state: no KV (the last run abandoned its requests), no
    // warm KV blocks, no idle or cached memory left mapped by warm-up or an earlier run.
    sync()?;
    for m in models.iter().filter(|m| !m.handle.is_asleep()) {
        if m.engine.kv.used() != 0 {
            return Err(format!(
                "{} starts a run holding {} KV blocks",
                m.handle.id(),
                m.engine.kv.used()
            ));
        }
        m.engine.kv.store.trim();
        m.handle
            .trim()
            .map_err(|e| format!("trim {}: {e}", m.handle.id()))?;
    }
    let resident = bases <= budget;
    if !resident && !matches!(policy, Policy::Sleep { .. }) {
        return Err(format!(
            "{}: the {k} models' weights and activations ({bases} bytes) exceed the budget of {budget} bytes; only the sleep policy serves more models than fit",
            policy.name()
        ));
    }
    // Awake at the start: every model when all fit; else (sleep) the first ones whose bases
    // leave a quarter of the budget for KV, the others asleep (host memory is held only for
    // those; they wake on demand).
    let mut awake_bases = 0u64;
    let awake: Vec<bool> = models
        .iter()
        .map(|m| {
            let a = resident || awake_bases + m.base <= budget - budget / 4;
            if a {
                awake_bases += m.base;
            }
            a
        })
        .collect();
    // Sleeps first: they make the room the wakes need.
    for (m, _) in models.iter().zip(&awake).filter(|(_, a)| !**a) {
        if !m.handle.is_asleep() {
            put_to_sleep(gpu, m, sync)?;
        }
    }
    for (m, _) in models.iter().zip(&awake).filter(|(_, a)| **a) {
        if m.handle.is_asleep() {
            m.handle
                .wake(AFTER_WAKE)
                .map_err(|e| format!("wake {}: {e}", m.handle.id()))?;
        }
    }
    let kv = budget.saturating_sub(if resident { bases } else { 0 });
    for m in models.iter_mut() {
        let bb = m.engine.kv.block_bytes();
        // Static shares in whole groups of blocks sharing pages (one block on the host).
        let unit = m.engine.kv.store.bytes_for(1).max(bb);
        let share = kv / k / unit * unit;
        let (limit, guarantee, cap) = match policy {
            Policy::Static => {
                let l = m.base + share;
                (l, l, share / bb)
            }
            Policy::Elastic => (budget, m.base, kv / bb),
            // A model may grow into whatever the others' bases leave when they sleep.
            Policy::Sleep { .. } => (budget, m.base, budget.saturating_sub(m.base) / bb),
        };
        gpu.set_limit(m.handle.id(), limit)
            .map_err(|e| e.to_string())?;
        m.engine.kv.cap = cap as usize;
        m.engine.kv.admit_cap = cap as usize;
        m.engine.kv.max_cap = cap as usize;
        m.engine.kv.base = m.base;
        m.engine.kv.reserve = policy != Policy::Static;
        m.guarantee = guarantee;
    }
    for m in models.iter().filter(|m| !m.handle.is_asleep()) {
        gpu.set_guarantee(m.handle.id(), m.guarantee)
            .map_err(|e| e.to_string())?;
    }
    Ok(kv)
}

/// Serve `trace` with `models` under `policy`. `sync` waits for the device to finish queued
/// work (sleep needs it). Every model is idle before and after; which models are asleep at
/// the start is [`apply_policy`]'s to say, and the end leaves them as they are.
pub fn run<S: BlockStore, M: StepModel>(
    gpu: &SharedPool,
    models: &mut [Served<S, M>],
    trace: &Trace,
    policy: Policy,
    label: &str,
    opts: RunOptions,
    sync: &dyn Fn() -> Result<(), String>,
) -> Result<RunSummary, String> {
    let wall = Instant::now();
    let kv_budget = apply_policy(gpu, models, policy, opts.budget, sync)?;
    let k = models.len();
    let mut tally: Vec<Tally> = (0..k).map(|_| Tally::default()).collect();
    let mut errors = Vec::new();
    let mut asleep: Vec<bool> = models.iter().map(|m| m.handle.is_asleep()).collect();
    let mut last_active = vec![0.0f64; k];
    let mut timeline = Vec::new();
    let fair: Vec<usize> = models
        .iter()
        .map(|m| (kv_budget / k as u64 / m.engine.kv.block_bytes()) as usize)
        .collect();
    let full_cap: Vec<usize> = models.iter().map(|m| m.engine.kv.cap).collect();
    let end = trace.config.duration_s + opts.drain_s;
    let mut now = 0.0f64;
    let mut next = 0usize;
    let mut rr = 0usize;
    let mut last_sample = f64::NEG_INFINITY;
    let mut sample_t = 0.0f64;
    let mut failures = 0u32;
    let driver0: Vec<_> = models
        .iter()
        .map(|m| m.handle.stats().driver_calls)
        .collect();
    let budget0: Vec<u64> = models
        .iter()
        .map(|m| m.engine.kv.budget_calls.get())
        .collect();
    // Per model: physical use, and what the policy holds for it (use or guarantee).
    let sample = |models: &[Served<S, M>]| -> (Vec<u64>, Vec<u64>) {
        models
            .iter()
            .map(|m| {
                m.handle
                    .model_stats()
                    .map_or((0, 0), |s| (s.used, s.used.max(s.guarantee)))
            })
            .unzip()
    };
    'run: loop {
        // Arrivals up to now (a sleeping model with requests wakes below).
        while next < trace.requests.len() && trace.requests[next].arrival() <= now {
            let r = trace.requests[next];
            next += 1;
            if r.model >= k {
                return Err(format!("request {} for model {} of {k}", r.id, r.model));
            }
            tally[r.model].requests += 1;
            models[r.model].engine.submit(r);
            last_active[r.model] = now;
        }
        // A sleeping model with requests wakes (other idle models sleeping, or other models'
        // requests preempted, to make room); when no room can be made it tries again later.
        for i in 0..k {
            if asleep[i] && models[i].engine.has_work() {
                let t = Instant::now();
                let woke = wake(
                    gpu,
                    models,
                    i,
                    &mut asleep,
                    &last_active,
                    opts.budget,
                    sync,
                    &mut tally,
                )?;
                now += t.elapsed().as_secs_f64();
                if woke {
                    tally[i].wakes += 1;
                    tally[i].wake_s += t.elapsed().as_secs_f64();
                    last_active[i] = now;
                }
            }
        }
        // Elastic: a model over its fair share admits nothing more while another waits for
        // memory.
        if policy != Policy::Static {
            let waiting: Vec<bool> = models
                .iter()
                .map(|m| {
                    m.engine
                        .head_need()
                        .is_some_and(|n| n > m.engine.kv.memory_available())
                })
                .collect();
            for i in 0..k {
                let contended = (0..k).any(|j| j != i && waiting[j]);
                models[i].engine.kv.admit_cap = if contended { fair[i] } else { full_cap[i] };
            }
        }
        // One step of the next model with work.
        let mut progressed = false;
        for off in 0..k {
            let i = (rr + off) % k;
            if asleep[i] || !models[i].engine.has_work() {
                continue;
            }
            let before = models[i].engine.counters;
            let dt = models[i].engine.step(now);
            let after = models[i].engine.counters;
            if after.oom > before.oom {
                if let Some(e) = models[i].engine.last_error.take() {
                    if errors.len() < 8 {
                        errors.push(format!("{}: {e}", models[i].handle.id()));
                    }
                }
                // A failed step takes no time: failing again and again would spin in place.
                failures += 1;
                if failures > MAX_FAILED_STEPS {
                    errors.push(format!(
                        "{MAX_FAILED_STEPS} failed steps in a row: run stopped at {now:.1} s"
                    ));
                    break 'run;
                }
            } else {
                failures = 0;
            }
            if after.prefills + after.decodes > before.prefills + before.decodes {
                now += dt;
                last_active[i] = now;
                rr = i + 1;
                let used = models[i].handle.model_stats().map_or(0, |s| s.used);
                tally[i].peak = tally[i].peak.max(used);
                progressed = true;
                for f in models[i].engine.finished.drain(..) {
                    tally[i].ttft.push(f.first_token - f.req.arrival());
                    if f.req.output > 1 {
                        tally[i]
                            .tpot
                            .push((f.done - f.first_token) / (f.req.output - 1) as f64);
                        tally[i].decode_s += f.done - f.first_token;
                        tally[i].decoded += (f.req.output - 1) as u64;
                    }
                }
                break;
            }
        }
        // Sleep models idle long enough.
        if let Policy::Sleep { idle_s } = policy {
            for i in 0..k {
                if !asleep[i] && !models[i].engine.has_work() && now - last_active[i] >= idle_s {
                    now += put_to_sleep(gpu, &models[i], sync)?;
                    asleep[i] = true;
                    tally[i].sleeps += 1;
                }
            }
        }
        // Memory samples (time-weighted mean, peak).
        if now - last_sample >= opts.sample_s || !progressed {
            let (used, held) = sample(models);
            let dt = if last_sample.is_finite() {
                now - sample_t
            } else {
                0.0
            };
            for ((t, &u), &h) in tally.iter_mut().zip(&used).zip(&held) {
                t.mem_integral += u as f64 * dt;
                t.held_integral += h as f64 * dt;
            }
            sample_t = now;
            last_sample = now;
            for (t, &u) in tally.iter_mut().zip(&used) {
                t.peak = t.peak.max(u);
            }
            timeline.push((now, used));
        }
        if now > end {
            break;
        }
        if !progressed {
            // Sleep: awake models that all wait for memory (nothing running, their next request
            // cannot get its blocks) with more than one awake: the least recently active of
            // those with nothing running sleeps, its base making room for the others (it wakes
            // again when a model goes idle).
            if matches!(policy, Policy::Sleep { .. }) {
                let still = |m: &Served<S, M>| m.engine.load().1 == 0;
                let stuck = (0..k).any(|i| {
                    !asleep[i]
                        && still(&models[i])
                        && models[i]
                            .engine
                            .head_need()
                            .is_some_and(|n| n > models[i].engine.kv.memory_available())
                });
                let awake = asleep.iter().filter(|a| !**a).count();
                let lru = (0..k)
                    .filter(|&i| !asleep[i] && still(&models[i]))
                    .min_by(|&a, &b| last_active[a].total_cmp(&last_active[b]));
                if let (true, true, Some(j)) = (stuck, awake > 1, lru) {
                    now += put_to_sleep(gpu, &models[j], sync)?;
                    asleep[j] = true;
                    tally[j].sleeps += 1;
                    continue;
                }
            }
            if next < trace.requests.len() {
                now = now.max(trace.requests[next].arrival());
            } else if models.iter().all(|m| !m.engine.has_work()) {
                break;
            } else {
                // Work left that cannot run (every model with work waits for memory no one
                // will free): stop and count it unfinished.
                let loads: Vec<_> = models
                    .iter()
                    .map(|m| {
                        let (q, r) = m.engine.load();
                        let st = m.handle.model_stats();
                        format!(
                            "{}: {q} queued, {r} running, needs {:?} blocks, {} to be had, {} held, in use {:?} guarantee {:?}, asleep {}",
                            m.handle.id(),
                            m.engine.head_need(),
                            m.engine.kv.memory_available(),
                            m.engine.kv.used(),
                            st.as_ref().map(|s| s.in_use),
                            st.as_ref().map(|s| s.guarantee),
                            m.handle.is_asleep()
                        )
                    })
                    .collect();
                errors.push(format!(
                    "stalled at {now:.1} s with work queued: {}",
                    loads.join("; ")
                ));
                break;
            }
        }
    }
    // Leave every model idle.
    for m in models.iter_mut() {
        let n = std::mem::take(&mut m.engine.kv.release_errors);
        if n > 0 {
            errors.push(format!("{}: {n} KV releases failed", m.handle.id()));
        }
    }
    for i in 0..k {
        tally[i].unfinished += models[i].engine.abandon() as u64;
        tally[i].counters = models[i].engine.counters;
        tally[i].driver_calls = models[i]
            .handle
            .stats()
            .driver_calls
            .since(&driver0[i])
            .total();
        tally[i].budget_calls = models[i].engine.kv.budget_calls.get() - budget0[i];
        models[i].engine.counters = EngineCounters::default();
        models[i].engine.refused.clear();
        models[i].engine.kv.admit_cap = full_cap[i];
    }
    let span = now.max(1e-9);
    let mut all = Tally::default();
    let mut per = Vec::new();
    for (t, m) in tally.iter_mut().zip(models.iter()) {
        per.push(t.summary(m.handle.id(), span));
        all.ttft.extend_from_slice(&t.ttft);
        all.tpot.extend_from_slice(&t.tpot);
        all.requests += t.requests;
        all.unfinished += t.unfinished;
        all.counters.refused += t.counters.refused;
        all.counters.tokens += t.counters.tokens;
        all.counters.preemptions += t.counters.preemptions;
        all.counters.oom += t.counters.oom;
        all.counters.prefills += t.counters.prefills;
        all.counters.decodes += t.counters.decodes;
        all.counters.decode_seqs += t.counters.decode_seqs;
        all.decode_s += t.decode_s;
        all.decoded += t.decoded;
        all.held_integral += t.held_integral;
        all.driver_calls += t.driver_calls;
        all.budget_calls += t.budget_calls;
        all.peak += t.peak;
        all.mem_integral += t.mem_integral;
        all.sleeps += t.sleeps;
        all.wakes += t.wakes;
        all.wake_s += t.wake_s;
    }
    let overall = all.summary("all", span);
    Ok(RunSummary {
        label: label.to_string(),
        policy,
        peak_rate: trace.config.peak_rate,
        duration_s: trace.config.duration_s,
        span_s: span,
        wall_s: wall.elapsed().as_secs_f64(),
        budget: opts.budget,
        kv_budget,
        models: per,
        overall,
        timeline,
        errors,
    })
}

/// Wake model `i`. While its memory is held: the least recently active idle awake model
/// sleeps, else, when the awake models' bases leave room for its base, the newest request of
/// the model holding the most KV is preempted. Returns whether it woke (`false`: no room can
/// be made now; it stays asleep and is tried again after the next step).
#[allow(clippy::too_many_arguments)]
fn wake<S: BlockStore, M: StepModel>(
    gpu: &SharedPool,
    models: &mut [Served<S, M>],
    i: usize,
    asleep: &mut [bool],
    last_active: &[f64],
    budget: u64,
    sync: &dyn Fn() -> Result<(), String>,
    tally: &mut [Tally],
) -> Result<bool, String> {
    loop {
        let e = match models[i].handle.wake(AFTER_WAKE) {
            Ok(_) => break,
            Err(e) => e,
        };
        if sleep_idlest(gpu, models, i, asleep, last_active, sync, tally)? {
            continue;
        }
        // Preempting KV helps only if the awake models' bases leave room for this one's.
        let bases: u64 = (0..models.len())
            .filter(|&j| j == i || !asleep[j])
            .map(|j| models[j].base)
            .sum();
        let victim = most_kv(models, i, asleep);
        if bases > budget || !victim.is_some_and(|j| models[j].engine.preempt_one()) {
            tracing::debug!(model = models[i].handle.id(), error = %e, "no room to wake yet");
            return Ok(false);
        }
    }
    asleep[i] = false;
    models[i].engine.kv.forget_guarantee();
    // Its guarantee back: room for its activations.
    let id = models[i].handle.id().to_string();
    while let Err(e) = gpu.set_guarantee(&id, models[i].guarantee) {
        // An idle model's base first (it sleeps), then other models' KV (preempted).
        if sleep_idlest(gpu, models, i, asleep, last_active, sync, tally)? {
            continue;
        }
        let victim = most_kv(models, i, asleep);
        if !victim.is_some_and(|j| models[j].engine.preempt_one()) {
            // No room for its activations beside the awake models' (waiting ones hold their
            // bases): back to sleep, woken again after the next step.
            tracing::debug!(model = %id, error = %e, "no room for the base after waking");
            put_to_sleep(gpu, &models[i], sync)?;
            asleep[i] = true;
            return Ok(false);
        }
    }
    Ok(true)
}

/// Put the least recently active idle awake model other than `i` to sleep; whether there was
/// one.
fn sleep_idlest<S: BlockStore, M: StepModel>(
    gpu: &SharedPool,
    models: &[Served<S, M>],
    i: usize,
    asleep: &mut [bool],
    last_active: &[f64],
    sync: &dyn Fn() -> Result<(), String>,
    tally: &mut [Tally],
) -> Result<bool, String> {
    let idle = (0..models.len())
        .filter(|&j| j != i && !asleep[j] && !models[j].engine.has_work())
        .min_by(|&a, &b| last_active[a].total_cmp(&last_active[b]));
    let Some(j) = idle else {
        return Ok(false);
    };
    put_to_sleep(gpu, &models[j], sync)?;
    asleep[j] = true;
    tally[j].sleeps += 1;
    Ok(true)
}

/// The awake model other than `i` holding the most KV.
fn most_kv<S: BlockStore, M: StepModel>(
    models: &[Served<S, M>],
    i: usize,
    asleep: &[bool],
) -> Option<usize> {
    (0..models.len())
        .filter(|&j| j != i && !asleep[j])
        .max_by_key(|&j| models[j].engine.kv.used())
}

/// Whether a run served its trace at a p99-TTFT SLO of `slo_s` seconds: every request
/// finished (none refused or left unfinished), no out-of-memory, no error, p99 TTFT within it.
pub fn meets_slo(s: &RunSummary, slo_s: f64) -> bool {
    let o = &s.overall;
    o.requests > 0
        && o.finished == o.requests
        && o.oom == 0
        && s.errors.is_empty()
        && o.ttft_p99 <= slo_s
}

/// One run of a model-count sweep.
#[derive(Debug, Clone)]
pub struct SweepPoint {
    /// Models served.
    pub models: usize,
    /// Policy.
    pub policy: Policy,
    /// Its summary (`None`: the policy could not run that many models, or was skipped).
    pub summary: Option<RunSummary>,
    /// Why there is no summary.
    pub error: Option<String>,
    /// Whether it met the SLO.
    pub meets: bool,
}

/// The sleep goal's experiment: for each policy, serve the first `n` models for each `n` of
/// `counts` (ascending) with `trace_for(n)`, the other models asleep (they hold no device
/// memory); a policy that misses the SLO at one count is not run at larger ones (recorded as
/// skipped). `on_point` sees each point as it finishes (print it, save it). Returns every
/// point; [`served_at_slo`] reads off the largest count each policy served.
#[allow(clippy::too_many_arguments)]
pub fn model_sweep<S: BlockStore, M: StepModel>(
    gpu: &SharedPool,
    models: &mut [Served<S, M>],
    counts: &[usize],
    policies: &[Policy],
    trace_for: &dyn Fn(usize) -> Result<Trace, String>,
    slo_s: f64,
    label: &str,
    opts: RunOptions,
    sync: &dyn Fn() -> Result<(), String>,
    on_point: &mut dyn FnMut(&SweepPoint) -> Result<(), String>,
) -> Result<Vec<SweepPoint>, String> {
    let mut counts = counts.to_vec();
    counts.sort_unstable();
    counts.dedup();
    if let Some(&n) = counts.iter().find(|&&n| n == 0 || n > models.len()) {
        return Err(format!(
            "a sweep over {n} models: between 1 and the {} loaded",
            models.len()
        ));
    }
    let mut points = Vec::new();
    for &policy in policies {
        let mut missed = false;
        for &n in &counts {
            let mut p = SweepPoint {
                models: n,
                policy,
                summary: None,
                error: None,
                meets: false,
            };
            if missed {
                p.error = Some("skipped: missed the SLO with fewer models".into());
            } else {
                // Models outside this point hold nothing on the device.
                for m in models[n..].iter().filter(|m| !m.handle.is_asleep()) {
                    put_to_sleep(gpu, m, sync)?;
                }
                let trace = trace_for(n)?;
                let name = format!("{label}-x{n}");
                match run(gpu, &mut models[..n], &trace, policy, &name, opts, sync) {
                    Ok(s) => {
                        p.meets = meets_slo(&s, slo_s);
                        p.summary = Some(s);
                    }
                    Err(e) => p.error = Some(e),
                }
                missed = !p.meets;
            }
            on_point(&p)?;
            points.push(p);
        }
    }
    Ok(points)
}

/// The most models each policy served at the SLO (0: none), in the order the policies first
/// appear in `points`.
pub fn served_at_slo(points: &[SweepPoint]) -> Vec<(Policy, usize)> {
    let mut out: Vec<(Policy, usize)> = Vec::new();
    for p in points {
        let n = if p.meets { p.models } else { 0 };
        match out.iter_mut().find(|(q, _)| q.name() == p.policy.name()) {
            Some((_, best)) => *best = (*best).max(n),
            None => out.push((p.policy, n)),
        }
    }
    out
}
