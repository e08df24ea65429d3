//! The deployment users run: one broker process and one engine process per model, on wall
//! clock, open loop.
//!
//! A deployment ([`Deployment`]) is started once per command and serves every run of it, as
//! engines in production are not restarted for each load. The driver starts a broker (this
//! binary re-executed in the broker role: `elastic_vmm::broker::Broker` on host memfds, or on
//! CUDA chunks with `--gpu`; its budget every model's base and the KV budget), waits for it,
//! then starts one engine process per model (the binary in the engine role, its
//! [`EngineSpec`] in a JSON file). Each engine connects with `BrokerClient`, registers two
//! models at the broker, as kvcached splits an engine's memory: its base (weights and
//! activations, limit and guarantee both the base, under every policy: no other engine's KV
//! can take the memory a step's activations need) and its KV, loads its weights, builds its
//! paged KV cache on the KV model's pool and says it is ready.
//!
//! A run: the driver sets each KV model's limit and guarantee for the policy over a control
//! connection (as an operator does with `elastic-vmm ctl`) and releases the broker's idle
//! chunks, so every run starts from the same state; it sends each engine its [`RunSpec`]
//! (`run <file>`; the engine says `armed`), then one start instant, a `CLOCK_MONOTONIC` time
//! (system-wide). From then on each engine runs on its own: a request is submitted to its
//! scheduler at the first loop turn at or after its arrival (whatever the engine was doing: a
//! step under way delays it, and that delay is in its TTFT, measured from the arrival); token
//! times are the wall clock when a step's compute returns, so allocation, mapping, the
//! broker's reclaim and hand-over between engines and any wait inside a step are all inside
//! TTFT and TPOT. On the host, compute is simulated (the step sleeps for `SimCost`'s time) so
//! that memory binds, not compute.
//!
//! At the run's end (trace plus drain) each engine writes a [`Record`] for every request of
//! its trace (finished, censored or refused), frees every block and gives its pages back, and
//! says `done`; the driver reads the reports and computes the run's statistics
//! ([`RunStats`]). When the command ends, the engines' input closes and they exit, then the
//! broker.
//!
//! Policies (the same engine; only the KV model's limit, guarantee and caps differ):
//! - `static-equal`: each KV model's limit and guarantee are 1/K of the KV budget;
//! - `static-best`: the same with shares proportional to each model's mean KV demand in its
//!   trace window (rate times `(prompt + output / 2) * output`: an oracle split no static
//!   operator can beat on average), each share at least the longest context an engine
//!   serves, so that no model is left unable to serve a request it would otherwise take;
//! - `elastic`: limit the whole KV budget, no guarantee (but its zero page). A model grows
//!   into what the others do not hold; the broker asks the others to give back (their idle
//!   chunks) when one cannot grow. An engine asked to give back (its reclaim callback) admits
//!   nothing beyond its fair share (1/K of the KV budget) for the next `CONTENDED_S`;
//! - `static-sleep`: whole models swapped. An awake model holds its base and a static share
//!   of the KV budget (1/R of it, R the models whose bases the budget holds: `resident`),
//!   both guaranteed; after `sleep_idle_s` with no work it sleeps (`sleeper.rs`: its base
//!   copied to host memory, its chunks and guarantees given back) and a request wakes it,
//!   when the broker has room for both guarantees (else it waits, in its TTFT);
//! - `elastic-sleep`: as `elastic`, and an idle model sleeps: a wake needs room for its base
//!   only, beside what the others use, so more models can be awake at once when their KV is
//!   small. Each run of a sleep policy starts with every model asleep. Sleeps are an idle
//!   timeout, as in Prism: nothing makes a busy model sleep for a waiting one, so a model
//!   whose requests never pause that long keeps its room, and the others' wait shows in their
//!   TTFT and censored requests.
//!
//! Roles are chosen by the variable [`ROLE_VAR`] (`broker` or `engine`) and [`SPEC_VAR`]; a
//! role talks to the driver by lines on stdin and stdout, each of its own lines holding
//! [`LINE_PREFIX`] then the word (a test harness may print other text, even ahead of it on
//! the line).

use std::cell::RefCell;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::backend::host::{ChunkFiles, HostBackend};
use elastic_vmm::backend::Backend;
use elastic_vmm::broker::{Broker, BrokerClient, BrokerConfig};
use elastic_vmm::kv::PagedKv;
use elastic_vmm::{MemOptions, ModelConfig, Tag};
use serde::{Deserialize, Serialize};

use crate::engine::{Engine, EngineConfig, EngineCounters, KvBlocks, SimCost, StepModel};
use crate::host::{kv_config, SimModel};
use crate::metrics::{Outcome, Record};
use crate::sleeper::Sleeper;
use crate::trace::Request;

/// The variable naming a child's role.
pub const ROLE_VAR: &str = "SERVE_ROLE";
/// The variable naming a child's spec file.
pub const SPEC_VAR: &str = "SERVE_SPEC";
/// The start of every line a role writes for the driver.
pub const LINE_PREFIX: &str = "serve-role:";
/// How long a role may take to get ready.
const READY_WAIT: Duration = Duration::from_secs(30);
/// Seconds an engine asked to give back keeps to its fair share.
pub const CONTENDED_S: f64 = 0.25;

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process of the machine.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC is always supported.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC)");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A memory policy of the deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeployPolicy {
    /// Equal static shares.
    StaticEqual,
    /// Static shares proportional to mean demand.
    StaticBest,
    /// One shared budget.
    Elastic,
    /// Whole models swapped: an awake model holds its base and a static share of the KV
    /// budget (1/`resident` of it); an idle one sleeps and gives both back.
    StaticSleep,
    /// Elastic KV, and an idle model sleeps (its base given back).
    ElasticSleep,
}

impl DeployPolicy {
    /// Its name.
    pub fn name(&self) -> &'static str {
        match self {
            DeployPolicy::StaticEqual => "static-equal",
            DeployPolicy::StaticBest => "static-best",
            DeployPolicy::Elastic => "elastic",
            DeployPolicy::StaticSleep => "static-sleep",
            DeployPolicy::ElasticSleep => "elastic-sleep",
        }
    }

    /// Whether an idle model sleeps.
    pub fn sleeps(&self) -> bool {
        matches!(self, DeployPolicy::StaticSleep | DeployPolicy::ElasticSleep)
    }

    /// Parse a name.
    pub fn parse(s: &str) -> Result<DeployPolicy, String> {
        [
            DeployPolicy::StaticEqual,
            DeployPolicy::StaticBest,
            DeployPolicy::Elastic,
            DeployPolicy::StaticSleep,
            DeployPolicy::ElasticSleep,
        ]
        .into_iter()
        .find(|p| p.name() == s)
        .ok_or_else(|| {
            format!("unknown policy {s:?}: static-equal, static-best, elastic, static-sleep or elastic-sleep")
        })
    }
}

/// A deployment's engines on the GPU: candle Llamas with random weights, real kernels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuEngines {
    /// Model size (`small` or `8b`, see `llama.rs`).
    pub size: String,
    /// Most tokens in one forward of a prefill.
    pub prefill_chunk: usize,
    /// The KV cache's block order (`token-major`, `head-major` or `split-k`).
    pub block_shape: String,
}

/// Sizes of a deployment: on the host backend with simulated compute (`gpu` is `None`), or
/// on the GPU with real engines.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeploySizes {
    /// The broker's chunk granularity (bytes).
    pub granularity: u64,
    /// Tokens per KV block.
    pub block_tokens: u32,
    /// KV blocks per mapped group: a cache maps memory for this many blocks at a time (1 on
    /// the host, where a block is one granule; a page of every layer's tensors on the GPU).
    pub group_blocks: u64,
    /// Bytes of one mapped group.
    pub group_bytes: u64,
    /// Weights per model (bytes).
    pub weights: u64,
    /// Activation bytes reserved per model (its base is weights plus this).
    pub act_reserve: u64,
    /// The paged KV cache's zero page (bytes; charged to the KV model).
    pub zero_page: u64,
    /// Activation bytes per token of a step (simulated compute).
    pub act_bytes_per_token: u64,
    /// KV blocks of all models together (the KV budget).
    pub kv_blocks: u64,
    /// Models whose bases the budget holds at once (the others asleep: sleep policies only).
    pub resident: usize,
    /// Engine limits.
    pub engine: EngineConfig,
    /// Step costs: the simulated compute's, or the GPU's cost model (which only sets the
    /// nominal load).
    pub cost: SimCost,
    /// Real engines on the GPU, or `None` for simulated compute on the host.
    pub gpu: Option<GpuEngines>,
    /// Simulated compute only: the engines take turns on one simulated device (a lock on a
    /// file beside the broker's socket, held for each step), each step costing what one
    /// engine alone takes (`cost` over `resident`), so that engines slow each other down only
    /// when they run at once, as engine processes time-slicing a GPU do. Without it every step
    /// costs `cost` whatever the others do.
    #[serde(default)]
    pub shared_device: bool,
}

impl DeploySizes {
    /// CI-sized: 256 KiB granules of 32 tokens, 1 MiB of weights and 1 MiB of activations
    /// per model, 192 KV blocks per model (6,144 tokens), batches of up to 64, contexts of up
    /// to 4,096 tokens.
    pub fn small(models: usize) -> DeploySizes {
        DeploySizes {
            granularity: 256 << 10,
            block_tokens: 32,
            group_blocks: 1,
            group_bytes: 256 << 10,
            weights: 1 << 20,
            act_reserve: 1 << 20,
            zero_page: 256 << 10,
            act_bytes_per_token: 128,
            kv_blocks: 192 * models as u64,
            resident: models,
            engine: EngineConfig {
                max_batch: 64,
                max_prefill_tokens: 2048,
                max_context: 4096,
            },
            cost: SimCost::memory_bound(),
            gpu: None,
            shared_device: false,
        }
    }

    /// A model's base: weights and activations.
    pub fn base(&self) -> u64 {
        self.weights + self.act_reserve
    }

    /// Memory a cache maps to hold `blocks` blocks.
    pub fn kv_bytes(&self, blocks: u64) -> u64 {
        blocks.div_ceil(self.group_blocks.max(1)) * self.group_bytes
    }

    /// The broker's budget for `models` models: the bases of the resident ones, every KV
    /// cache's zero page and the KV budget.
    pub fn budget(&self, models: usize) -> u64 {
        self.bases(models) + self.kv_bytes(self.kv_blocks)
    }

    /// What the budget holds besides KV for `models` models: the resident ones' bases and
    /// every KV cache's zero page.
    pub fn bases(&self, models: usize) -> u64 {
        let resident = self.resident.clamp(1, models.max(1)) as u64;
        self.base() * resident + self.zero_page * models as u64
    }
}

/// What one engine process does.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineSpec {
    /// The broker's socket.
    pub socket: PathBuf,
    /// Model index.
    pub model: usize,
    /// Sizes.
    pub sizes: DeploySizes,
    /// Its KV model's limit at the broker (bytes); its base model's limit and guarantee are
    /// the sizes' base.
    pub limit: u64,
    /// Its KV model's guarantee at the broker (bytes).
    pub guarantee: u64,
    /// Whether runs may put it to sleep: it keeps host memory for its base's copy (pinned
    /// once at the start, off the sleep path) and a control connection to give its
    /// guarantees back while asleep.
    pub sleeps: bool,
}

/// How a model sleeps in a run of a sleep policy.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct SleepSpec {
    /// Seconds with no work after which it sleeps.
    pub idle_s: f64,
    /// Its KV model's guarantee while awake (bytes): a static share, or the zero page
    /// (elastic); the zero page while asleep.
    pub kv_guarantee: u64,
}

/// One run of an engine process (it serves runs one after the other; the driver sets its
/// KV model's limit and guarantee at the broker before each).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSpec {
    /// KV blocks it may hold (its share under a static policy, the whole KV budget else).
    pub cap_blocks: usize,
    /// Its fair share (blocks), kept to while another model waits (elastic).
    pub fair_blocks: usize,
    /// Seconds from the start instant at which it stops.
    pub end_s: f64,
    /// Its requests, arrivals in seconds from the start instant.
    pub requests: Vec<Request>,
    /// Where it writes its [`EngineReport`].
    pub out: PathBuf,
    /// A sleep policy's terms: the run starts with the model asleep; `None`: awake
    /// throughout.
    pub sleep: Option<SleepSpec>,
}

/// What an engine process reports at its end.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EngineReport {
    /// Model index.
    pub model: usize,
    /// A record per request of its trace.
    pub records: Vec<Record>,
    /// Its scheduler's counters.
    pub counters: EngineCounters,
    /// KV allocations the broker refused.
    pub kv_refusals: u64,
    /// Wall seconds spent in KV allocations that succeeded (mapping, growth at the broker,
    /// hand-over from other engines included).
    pub kv_alloc_s: f64,
    /// Wall seconds spent in KV allocations that were refused (the broker's reclaim from
    /// other engines included).
    pub kv_refused_s: f64,
    /// Reclaim requests the broker sent it.
    pub reclaims: u64,
    /// Most KV blocks it held at once.
    pub peak_blocks: usize,
    /// Seconds from its process start to ready (connect, register, weights, KV cache).
    pub setup_s: f64,
    /// Its base as measured (bytes): weights and the warm-up's activations on the GPU.
    #[serde(default)]
    pub base: u64,
    /// Errors seen (failed steps).
    pub errors: Vec<String>,
    /// Sleeps and wakes in the run.
    #[serde(default)]
    pub sleeps: u64,
    /// Wakes in the run.
    #[serde(default)]
    pub wakes: u64,
    /// Wakes that waited for room at the broker (another model's sleep).
    #[serde(default)]
    pub wakes_waited: u64,
    /// Seconds those wakes waited.
    #[serde(default)]
    pub wake_wait_s: f64,
    /// Wall seconds in sleeps (copies out, chunks and guarantees given back).
    #[serde(default)]
    pub sleep_s: f64,
    /// Wall seconds in wakes that succeeded (guarantees, chunks, copies back).
    #[serde(default)]
    pub wake_s: f64,
}

/// A paged KV cache on a broker model as the scheduler sees it: blocks it may hold by the
/// policy's caps; whether memory is there is the broker's to say at `alloc`.
struct BrokerKv {
    store: KvStore,
    block_tokens: u32,
    held: usize,
    peak: usize,
    cap: usize,
    admit_cap: usize,
    refusals: u64,
    alloc_s: f64,
    refused_s: f64,
    /// No admission before this (a back-off after a refusal).
    retry_at: Instant,
    /// The last back-off (seconds).
    backoff: f64,
}

/// The cache under a [`BrokerKv`]: plain on the host, candle tensors on the GPU.
enum KvStore {
    Host(PagedKv),
    #[cfg(feature = "candle-example")]
    Gpu(Arc<elastic_vmm::candle::PagedKvTensors>),
}

impl KvStore {
    fn kv(&self) -> &PagedKv {
        match self {
            KvStore::Host(kv) => kv,
            #[cfg(feature = "candle-example")]
            KvStore::Gpu(t) => t.cache(),
        }
    }
}

impl BrokerKv {
    /// A new run: at most `cap` blocks, counters at zero.
    fn reset(&mut self, cap: usize) {
        self.peak = self.held;
        self.cap = cap;
        self.admit_cap = cap;
        self.refusals = 0;
        self.alloc_s = 0.0;
        self.refused_s = 0.0;
        self.retry_at = Instant::now();
        self.backoff = 0.0;
    }

    fn new(store: KvStore, block_tokens: u32, cap: usize) -> BrokerKv {
        BrokerKv {
            store,
            block_tokens,
            held: 0,
            peak: 0,
            cap,
            admit_cap: cap,
            refusals: 0,
            alloc_s: 0.0,
            refused_s: 0.0,
            retry_at: Instant::now(),
            backoff: 0.0,
        }
    }
}

/// Back-off after a refused KV allocation: from the first, doubling to the second (seconds).
const BACKOFF_S: (f64, f64) = (0.002, 0.032);

impl KvBlocks for BrokerKv {
    fn block_tokens(&self) -> u32 {
        self.block_tokens
    }
    fn available(&mut self) -> usize {
        // After a refusal, nothing is asked of the broker again until a block was freed here
        // or the back-off passed (each refusal makes the broker ask the others for memory).
        if Instant::now() < self.retry_at {
            return 0;
        }
        self.admit_cap.min(self.cap).saturating_sub(self.held)
    }
    fn capacity(&self) -> usize {
        self.cap
    }
    fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.held + n > self.cap {
            return None;
        }
        let t = Instant::now();
        let r = self.store.kv().alloc(n);
        let dt = t.elapsed().as_secs_f64();
        match r {
            Ok(ids) => {
                self.backoff = 0.0;
                self.alloc_s += dt;
                self.held += ids.len();
                self.peak = self.peak.max(self.held);
                Some(ids.into_iter().map(|i| i as u32).collect())
            }
            Err(e) => {
                tracing::debug!(n, error = %e, "KV blocks refused");
                self.refused_s += dt;
                self.refusals += 1;
                self.backoff = (self.backoff * 2.0).clamp(BACKOFF_S.0, BACKOFF_S.1);
                self.retry_at = Instant::now() + Duration::from_secs_f64(self.backoff);
                None
            }
        }
    }
    fn free(&mut self, ids: &[u32]) {
        let ids: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
        match self.store.kv().free(&ids) {
            Ok(()) => {
                self.held -= ids.len();
                self.retry_at = Instant::now();
            }
            Err(e) => tracing::error!(error = %e, "KV release failed"),
        }
    }
    fn used(&self) -> usize {
        self.held
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{LINE_PREFIX}{line}");
    let _ = out.flush();
}

/// Run this process's role if [`ROLE_VAR`] names one: `Some(result)` then, `None` else.
pub fn run_role() -> Option<Result<(), String>> {
    let role = std::env::var(ROLE_VAR).ok()?;
    let spec = std::env::var(SPEC_VAR).map_err(|_| format!("{SPEC_VAR} not set"));
    Some(spec.and_then(|spec| match role.as_str() {
        "broker" => broker_role(Path::new(&spec)),
        "engine" => engine_role(Path::new(&spec)),
        other => Err(format!("unknown role {other:?}")),
    }))
}

/// The broker's spec.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct BrokerSpec {
    socket: PathBuf,
    /// Its budget; 0 on the GPU: the device's free memory less `reserve` (it says which in
    /// its [`BrokerInfo`]).
    budget: u64,
    granularity: u64,
    reclaim_wait_ms: u64,
    /// CUDA chunks on device 0 (else host memory).
    cuda: bool,
    /// Bytes of the device left outside the budget (the engines' CUDA contexts, cuBLAS).
    reserve: u64,
    /// Where it writes its [`BrokerInfo`].
    out: PathBuf,
}

/// What the broker says about itself once ready.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BrokerInfo {
    /// Its budget (bytes).
    pub budget: u64,
    /// The device's free memory when it started, and in total.
    pub free: u64,
    /// Total memory.
    pub total: u64,
    /// The device, as the backend names it.
    pub device: String,
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

fn write_json<T: Serialize>(path: &Path, v: &T) -> Result<(), String> {
    let bytes = serde_json::to_vec(v).map_err(|e| e.to_string())?;
    std::fs::write(path, bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// Raise the open-files limit to its hard limit (the broker holds a descriptor per chunk).
fn raise_nofile() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid rlimit to fill and then pass back.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

fn broker_role(spec: &Path) -> Result<(), String> {
    let spec: BrokerSpec = read_json(spec)?;
    raise_nofile();
    let e = |e: elastic_vmm::Error| e.to_string();
    let backend: Arc<dyn Backend> = if spec.cuda {
        Arc::new(CudaBackend::new(0).map_err(e)?)
    } else {
        Arc::new(
            HostBackend::with_chunk_files(spec.granularity as usize, ChunkFiles::PerChunk)
                .map_err(e)?,
        )
    };
    let mem = backend.memory_info().map_err(e)?;
    let budget = match spec.budget {
        0 => mem.free.saturating_sub(spec.reserve),
        b if spec.cuda && b > mem.free => {
            return Err(format!(
                "a budget of {b} bytes does not fit the device's {} free bytes",
                mem.free
            ))
        }
        b => b,
    };
    let config = BrokerConfig::new(&spec.socket, budget)
        .reclaim_wait(Duration::from_millis(spec.reclaim_wait_ms));
    let info = BrokerInfo {
        budget,
        free: mem.free,
        total: mem.total,
        device: backend.info().device_name.clone(),
    };
    let broker = Broker::start(backend, config).map_err(e)?;
    write_json(&spec.out, &info)?;
    say("ready");
    // Serve until the driver closes stdin.
    let mut sink = String::new();
    while std::io::stdin()
        .read_line(&mut sink)
        .map_err(|e| e.to_string())?
        > 0
    {
        sink.clear();
    }
    broker.shutdown();
    Ok(())
}

fn engine_role(spec: &Path) -> Result<(), String> {
    let born = Instant::now();
    let spec: EngineSpec = read_json(spec)?;
    raise_nofile();
    let s = &spec.sizes;
    let e = |e: elastic_vmm::Error| e.to_string();
    let id = format!("model-{}", spec.model);
    let client = BrokerClient::connect(&spec.socket, &id).map_err(e)?;
    // Asked to give back: another model cannot grow. The pool gives its idle chunks back by
    // itself; the engine keeps to its fair share for a while.
    let asked = Arc::new(AtomicU64::new(0));
    let reclaims = Arc::new(AtomicU64::new(0));
    let (a, r) = (asked.clone(), reclaims.clone());
    // Room for the weights and activations, and for a KV cache of the whole KV budget, twice
    // over each.
    let room = |b: u64| {
        let v = 2 * b + (64 << 20);
        usize::try_from(v).map_err(|_| format!("{v} bytes of address space"))
    };
    let model = client
        .register(ModelConfig::new(&id, room(s.base())?, s.base()).guarantee(s.base()))
        .map_err(e)?;
    let kv_id = format!("{id}-kv");
    let config = ModelConfig::new(&kv_id, room(s.kv_bytes(s.kv_blocks))?, spec.limit)
        .guarantee(spec.guarantee)
        .on_reclaim(move |_| {
            a.store(monotonic_ns(), Ordering::Relaxed);
            r.fetch_add(1, Ordering::Relaxed);
        });
    let kv_model = client.register(config).map_err(e)?;
    let blocks = s.kv_blocks as usize;
    let ctx = Serving {
        spec: &spec,
        born,
        asked: &asked,
        reclaims: &reclaims,
        kv_pool: kv_model.pool(),
        sleeper: RefCell::new(None),
    };
    // Host memory for a sleeping base's copy: what the base pool maps once loaded.
    let sleeper = |pool: &elastic_vmm::Pool| -> Result<(), String> {
        if spec.sleeps {
            let staging = pool.stats().mapped.max(s.granularity);
            let z = Sleeper::new(&spec.socket, &id, pool, s.base(), s.zero_page, staging)?;
            *ctx.sleeper.borrow_mut() = Some(z);
        }
        Ok(())
    };
    match &s.gpu {
        None => {
            let mut weights = model
                .allocate_with(s.weights as usize, &MemOptions::new().tag(Tag::Weights))
                .map_err(e)?;
            let pattern = 0x5A ^ spec.model as u8;
            weights.fill(pattern).map_err(e)?;
            let store = PagedKv::new(
                kv_model.pool(),
                kv_config(blocks, s.block_tokens, s.granularity)?,
            )
            .map_err(e)?;
            let (cost, device) = if s.shared_device {
                let k = s.resident.max(1) as f64;
                let solo = SimCost {
                    step_s: s.cost.step_s / k,
                    prefill_token_s: s.cost.prefill_token_s / k,
                    decode_seq_s: s.cost.decode_seq_s / k,
                    context_token_s: s.cost.context_token_s / k,
                };
                let path = spec.socket.with_extension("device");
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&path)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                (solo, Some(file))
            } else {
                (s.cost, None)
            };
            let sim = SimModel {
                pool: model.pool().clone(),
                cost,
                act_bytes_per_token: s.act_bytes_per_token,
                weights,
                pattern,
                wall: true,
                device,
            };
            let kv = BrokerKv::new(KvStore::Host(store), s.block_tokens, blocks);
            sleeper(model.pool())?;
            let check = |m: &SimModel| match m.weights_intact()? {
                true => Ok(()),
                false => Err(format!("{id}: weights changed during the run")),
            };
            ctx.serve(Engine::new(kv, sim, s.engine), s.base(), check)?;
        }
        #[cfg(feature = "candle-example")]
        Some(g) => {
            use crate::llama::{engine_model, parse_block_shape, Size};
            let size = Size::parse(&g.size)?;
            let m = engine_model(
                size,
                model.pool(),
                kv_model.pool(),
                &id,
                blocks,
                s.engine,
                g.prefill_chunk,
                parse_block_shape(&g.block_shape)?,
            )?;
            // What the model holds besides KV: mapped after the warm-up (weights and any gaps
            // between them) and the warm-up's activations. More than planned would fail its
            // steps: refused, with the numbers.
            let base = m.held + m.act_peak;
            if base > s.base() {
                return Err(format!(
                    "{id}: its base is {base} bytes ({} held after loading, {} of activations at the warm-up's peak), more than the {} planned: raise --act-reserve-gib",
                    m.held,
                    m.act_peak,
                    s.base()
                ));
            }
            let kv = BrokerKv::new(KvStore::Gpu(m.kv.clone()), s.block_tokens, blocks);
            sleeper(model.pool())?;
            // The weights as loaded, checked after every run and every wake.
            let reference = m.model.fingerprint()?;
            let check = move |x: &crate::llama::LlamaModel| x.check_weights(&reference);
            let engine = ctx.serve(Engine::new(kv, m.model, s.engine), base, check)?;
            drop(engine);
            drop(m.kv);
            drop(m.tensors);
        }
        #[cfg(not(feature = "candle-example"))]
        Some(_) => return Err("built without the candle-example feature: no GPU engine".into()),
    }
    Ok(())
}

/// A line from the driver; `None` at the end of its input.
fn read_line() -> Result<Option<String>, String> {
    let mut line = String::new();
    match std::io::stdin().read_line(&mut line) {
        Ok(0) => Ok(None),
        Ok(_) => Ok(Some(line.trim().to_string())),
        Err(e) => Err(e.to_string()),
    }
}

/// What an engine's serving loop needs besides its engine.
struct Serving<'a> {
    spec: &'a EngineSpec,
    born: Instant,
    asked: &'a AtomicU64,
    reclaims: &'a AtomicU64,
    /// The KV model's pool, trimmed after each run.
    kv_pool: &'a elastic_vmm::Pool,
    /// Sleep and wake, where runs may put the model to sleep.
    sleeper: RefCell<Option<Sleeper>>,
}

impl Serving<'_> {
    /// Say ready, then serve runs until the driver's input ends: for each, `run <spec file>`
    /// (the engine says `armed`), `start <ns>` (the shared start instant), the trace on wall
    /// clock until its end, a report of every request (written to the run's `out`; the engine
    /// says `done`), `check` of the model, and every KV page given back. `base` is the
    /// model's measured base (bytes).
    fn serve<M: StepModel>(
        &self,
        mut engine: Engine<BrokerKv, M>,
        base: u64,
        check: impl Fn(&M) -> Result<(), String>,
    ) -> Result<Engine<BrokerKv, M>, String> {
        let setup_s = self.born.elapsed().as_secs_f64();
        say("ready");
        while let Some(line) = read_line()? {
            if line == "sleep" {
                // The deployment's start: models beyond what the budget holds load one by
                // one, each asleep before the next.
                let mut z = self.sleeper.borrow_mut();
                let z = z
                    .as_mut()
                    .ok_or("`sleep` to an engine started without sleeps")?;
                z.sleep(engine.kv.store.kv(), self.kv_pool)?;
                say("asleep");
                continue;
            }
            let path = line
                .strip_prefix("run ")
                .ok_or_else(|| format!("expected `run <spec>`, got {line:?}"))?;
            let run: RunSpec = read_json(Path::new(path))?;
            let report = self.run(&mut engine, &run, base, setup_s, &check)?;
            // Asleep, the weights are checked after the next wake instead.
            if !self
                .sleeper
                .borrow()
                .as_ref()
                .is_some_and(|z| z.is_asleep())
            {
                check(&engine.model)?;
            }
            // The next run starts from nothing: no block held, every page back at the broker.
            engine.kv.store.kv().trim();
            self.kv_pool.trim().map_err(|e| e.to_string())?;
            write_json(&run.out, &report)?;
            say("done");
        }
        Ok(engine)
    }

    /// One run; see [`Serving::serve`]. `check` runs after every wake.
    fn run<M: StepModel>(
        &self,
        engine: &mut Engine<BrokerKv, M>,
        spec: &RunSpec,
        base: u64,
        setup_s: f64,
        check: &impl Fn(&M) -> Result<(), String>,
    ) -> Result<EngineReport, String> {
        engine.counters = EngineCounters::default();
        engine.last_error = None;
        if engine.kv.held != 0 {
            return Err(format!(
                "model {}: {} KV blocks still held from the last run",
                self.spec.model, engine.kv.held
            ));
        }
        engine.kv.reset(spec.cap_blocks);
        let mut sleeper = self.sleeper.borrow_mut();
        if let Some(z) = sleeper.as_mut() {
            if spec.sleep.is_some() {
                // A sleep policy's run starts with every model asleep.
                z.sleep(engine.kv.store.kv(), self.kv_pool)?;
            } else {
                // Awake throughout: the driver set the KV guarantees; the base's comes back
                // once the other models' sleeps gave theirs back.
                let until = Instant::now() + READY_WAIT;
                while !z.try_wake(None)? {
                    if Instant::now() > until {
                        return Err(format!(
                            "model {}: no room to wake for {READY_WAIT:?}",
                            self.spec.model
                        ));
                    }
                    std::thread::sleep(z.backoff());
                }
                check(&engine.model)?;
            }
            z.counts = Default::default();
        }
        // A give-back asked during the last run (or by the limit change) holds nothing here.
        self.asked.store(0, Ordering::Relaxed);
        let before_reclaims = self.reclaims.load(Ordering::Relaxed);
        say("armed");
        let line = read_line()?.unwrap_or_default();
        let start: u64 = line
            .strip_prefix("start ")
            .and_then(|x| x.parse().ok())
            .ok_or_else(|| format!("expected `start <ns>`, got {line:?}"))?;
        let clock = move || (monotonic_ns() as f64 - start as f64) / 1e9;
        engine.clock = Some(Box::new(clock));
        let mut errors = Vec::new();
        let reqs = &spec.requests;
        let mut next = 0;
        let mut idle_since = 0.0;
        loop {
            let now = clock();
            if now >= spec.end_s {
                break;
            }
            while next < reqs.len() && reqs[next].arrival() <= now {
                engine.submit(reqs[next]);
                next += 1;
            }
            if let (Some(terms), Some(z)) = (spec.sleep, sleeper.as_mut()) {
                if engine.has_work() {
                    idle_since = now;
                    // Asleep with work: wake, or wait for room (the requests' TTFT runs).
                    let kv = Some(terms.kv_guarantee).filter(|g| *g > self.spec.sizes.zero_page);
                    if z.is_asleep() {
                        if !z.try_wake(kv)? {
                            std::thread::sleep(z.backoff());
                            continue;
                        }
                        check(&engine.model)?;
                    }
                } else if !z.is_asleep() && now - idle_since >= terms.idle_s && engine.kv.held == 0
                {
                    z.sleep(engine.kv.store.kv(), self.kv_pool)?;
                }
            }
            let since_asked =
                (monotonic_ns() as f64 - self.asked.load(Ordering::Relaxed) as f64) / 1e9;
            engine.kv.admit_cap = if since_asked < CONTENDED_S {
                spec.fair_blocks
            } else {
                engine.kv.cap
            };
            let before = engine.counters;
            if engine.has_work() {
                engine.step(now);
            }
            if engine.counters.oom > before.oom {
                if let Some(err) = engine.last_error.take() {
                    if errors.len() < 8 {
                        errors.push(err);
                    }
                }
            }
            let ran = engine.counters.prefills + engine.counters.decodes
                > before.prefills + before.decodes;
            if !ran {
                // Nothing ran: idle until the next arrival, or retry admission shortly.
                let next_at = reqs.get(next).map_or(f64::INFINITY, |r| r.arrival());
                let retry = if engine.has_work() {
                    now + 0.002
                } else {
                    f64::INFINITY
                };
                let until = next_at.min(retry).min(spec.end_s);
                let wait = (until - clock()).max(0.0);
                std::thread::sleep(Duration::from_secs_f64(wait.min(0.05)));
            }
        }
        let model = self.spec.model;
        let records = records(model, spec, engine, next);
        let slept = sleeper.as_ref().map(|z| z.counts).unwrap_or_default();
        Ok(EngineReport {
            model,
            records,
            counters: engine.counters,
            kv_refusals: engine.kv.refusals,
            kv_alloc_s: engine.kv.alloc_s,
            kv_refused_s: engine.kv.refused_s,
            reclaims: self.reclaims.load(Ordering::Relaxed) - before_reclaims,
            peak_blocks: engine.kv.peak,
            setup_s,
            base,
            errors,
            sleeps: slept.sleeps,
            wakes: slept.wakes,
            wakes_waited: slept.waited,
            wake_wait_s: slept.wait_s,
            sleep_s: slept.sleep_s,
            wake_s: slept.wake_s,
        })
    }
}

/// A record for every request of `spec`'s trace: finished, censored at the run's end
/// (running, queued, or not arrived by then: `next` is the first not submitted) or refused.
fn records<M: StepModel>(
    model: usize,
    spec: &RunSpec,
    engine: &mut Engine<BrokerKv, M>,
    next: usize,
) -> Vec<Record> {
    let (reqs, end) = (&spec.requests, spec.end_s);
    let mut records = Vec::with_capacity(reqs.len());
    for f in engine.finished.drain(..) {
        records.push(Record {
            model,
            id: f.req.id,
            arrival: f.req.arrival(),
            first_token: Some(f.first_token),
            finish: Some(f.done),
            prompt: f.req.prompt,
            output: f.req.output,
            generated: f.req.output,
            outcome: Outcome::Finished,
            preemptions: f.preemptions,
        });
    }
    for u in engine.take_unfinished() {
        records.push(Record {
            model,
            id: u.req.id,
            arrival: u.req.arrival(),
            first_token: u.first_token,
            finish: None,
            prompt: u.req.prompt,
            output: u.req.output,
            generated: u.generated,
            outcome: Outcome::Censored,
            preemptions: u.preemptions,
        });
    }
    for r in engine.refused.drain(..) {
        records.push(Record {
            model,
            id: r.id,
            arrival: r.arrival(),
            first_token: None,
            finish: None,
            prompt: r.prompt,
            output: r.output,
            generated: 0,
            outcome: Outcome::Refused,
            preemptions: 0,
        });
    }
    // Requests that had not arrived by the end (a late start) are censored too.
    for r in &reqs[next.min(reqs.len())..] {
        records.push(Record {
            model,
            id: r.id,
            arrival: r.arrival().min(end),
            first_token: None,
            finish: None,
            prompt: r.prompt,
            output: r.output,
            generated: 0,
            outcome: Outcome::Censored,
            preemptions: 0,
        });
    }
    records.sort_by_key(|r| r.id);
    records
}

/// How to start this binary in a role: the executable and the arguments that make it run
/// [`run_role`] (none for the serve binary; a test binary's filter for its role test).
#[derive(Debug, Clone)]
pub struct Launcher {
    /// The executable.
    pub exe: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
}

impl Launcher {
    /// This very binary, no arguments.
    pub fn this() -> Result<Launcher, String> {
        Ok(Launcher {
            exe: std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?,
            args: Vec::new(),
        })
    }

    fn spawn(&self, role: &str, spec: &Path) -> Result<Role, String> {
        let mut child = Command::new(&self.exe)
            .args(&self.args)
            .env(ROLE_VAR, role)
            .env(SPEC_VAR, spec)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawning {} as {role}: {e}", self.exe.display()))?;
        let stdin = child.stdin.take();
        // Its lines come through a channel, so that waiting for one can time out.
        let (tx, lines) = mpsc::channel();
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Role {
            name: role.to_string(),
            child,
            stdin,
            lines,
        })
    }
}

/// A child in a role.
struct Role {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Role {
    /// Wait up to `timeout` for its line `want` (other lines are skipped); an error if it
    /// ends or the time passes first.
    fn expect(&mut self, want: &str, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match self.lines.recv_timeout(left) {
                Ok(l) => l,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(format!(
                        "{} did not say {want:?} within {timeout:?}",
                        self.name
                    ))
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.wait().map_err(|e| e.to_string())?;
                    return Err(format!(
                        "{} ended ({status}) before saying {want:?}",
                        self.name
                    ));
                }
            };
            // A test harness may have started the line already.
            let said = line
                .find(LINE_PREFIX)
                .map(|i| line[i + LINE_PREFIX.len()..].trim_end());
            if said == Some(want) {
                return Ok(());
            }
        }
    }

    fn send(&mut self, line: &str) -> Result<(), String> {
        let w = self
            .stdin
            .as_mut()
            .ok_or_else(|| format!("{}: no stdin", self.name))?;
        writeln!(w, "{line}")
            .and_then(|()| w.flush())
            .map_err(|e| format!("{}: {e}", self.name))
    }

    /// Wait for it to exit, killing it after `deadline`.
    fn finish(mut self, deadline: Instant) -> Result<(), String> {
        drop(self.stdin.take());
        loop {
            if let Some(st) = self.child.try_wait().map_err(|e| e.to_string())? {
                return if st.success() {
                    Ok(())
                } else {
                    Err(format!("{} exited with {st}", self.name))
                };
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return Err(format!("{} did not exit in time: killed", self.name));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        // A child left running (an error half way) is ended: it is ours.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One run: the policy's limits for every model, their requests.
#[derive(Debug, Clone)]
pub struct Point {
    /// Policy.
    pub policy: DeployPolicy,
    /// Sizes.
    pub sizes: DeploySizes,
    /// Per model: its requests (arrivals from the start instant).
    pub requests: Vec<Vec<Request>>,
    /// Per model: its mean KV demand (any unit; static-best splits by it).
    pub demand: Vec<f64>,
    /// Seconds of trace.
    pub duration_s: f64,
    /// Seconds after the trace before the run ends.
    pub drain_s: f64,
    /// How long the broker waits for other engines to give memory back before it refuses a
    /// growth (`BrokerConfig::reclaim_wait`; milliseconds).
    pub reclaim_wait_ms: u64,
    /// Sleep policies: seconds with no work after which a model sleeps.
    pub sleep_idle_s: f64,
}

/// Each model's KV blocks under a static split proportional to `weights`: whole blocks, at
/// least `floor` each (what an operator gives every model: room for its longest request)
/// when `total` has room for that, the rest by weight, summing to at most `total`. Equal
/// shares when no weight is positive.
pub fn static_shares(total: usize, weights: &[f64], floor: usize) -> Vec<usize> {
    let k = weights.len().max(1);
    let floor = floor.min(total / k);
    let sum: f64 = weights.iter().filter(|w| w.is_finite() && **w > 0.0).sum();
    if sum <= 0.0 {
        return vec![total / k; weights.len()];
    }
    let free = total - floor * weights.len();
    weights
        .iter()
        .map(|&w| {
            let w = if w.is_finite() { w.max(0.0) } else { 0.0 };
            floor + (free as f64 * w / sum).floor() as usize
        })
        .collect()
}

/// A run's results: every engine's report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PointResult {
    /// Per model, in model order.
    pub engines: Vec<EngineReport>,
    /// When the run ended (seconds from the start instant).
    pub end_s: f64,
    /// Wall seconds the whole run took (processes started and stopped included).
    pub wall_s: f64,
}

impl PointResult {
    /// Every record of every model.
    pub fn records(&self) -> Vec<Record> {
        self.engines
            .iter()
            .flat_map(|e| e.records.iter().copied())
            .collect()
    }
}

/// A private temporary folder for the run's socket and files.
fn temp_dir() -> Result<PathBuf, String> {
    let d = std::env::temp_dir().join(format!("serve-{}-{}", std::process::id(), monotonic_ns()));
    std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
    std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .map_err(|e| format!("{}: {e}", d.display()))?;
    Ok(d)
}

/// How long a role may take to get ready: engines on the GPU load and warm a model.
fn ready_wait(s: &DeploySizes) -> Duration {
    if s.gpu.is_some() {
        READY_WAIT * 6
    } else {
        READY_WAIT
    }
}

/// Start the broker for `s` in `dir` with `budget` (0 on the GPU: the device's free memory
/// less the reserve, see [`probe_budget`]); ready when this returns, with what it says.
fn start_broker(
    launcher: &Launcher,
    dir: &Path,
    s: &DeploySizes,
    budget: u64,
    reclaim_wait_ms: u64,
) -> Result<(Role, BrokerInfo), String> {
    start_broker_reserving(launcher, dir, s, budget, 0, reclaim_wait_ms)
}

fn start_broker_reserving(
    launcher: &Launcher,
    dir: &Path,
    s: &DeploySizes,
    budget: u64,
    reserve: u64,
    reclaim_wait_ms: u64,
) -> Result<(Role, BrokerInfo), String> {
    let bspec = dir.join("broker.json");
    let out = dir.join("broker.out.json");
    write_json(
        &bspec,
        &BrokerSpec {
            socket: dir.join("broker.sock"),
            budget,
            granularity: s.granularity,
            reclaim_wait_ms,
            cuda: s.gpu.is_some(),
            reserve,
            out: out.clone(),
        },
    )?;
    let mut broker = launcher.spawn("broker", &bspec)?;
    broker.expect("ready", ready_wait(s))?;
    let info = read_json(&out)?;
    Ok((broker, info))
}

/// What a broker for `s` would have as its budget with `reserve` bytes of the device left
/// to the engines' contexts (the device's free memory less that; on the host, `s`'s own).
pub fn probe_budget(
    launcher: &Launcher,
    s: &DeploySizes,
    reserve: u64,
) -> Result<BrokerInfo, String> {
    let dir = temp_dir()?;
    let r = (|| {
        let budget = if s.gpu.is_some() { 0 } else { s.budget(1) };
        let (broker, info) = start_broker_reserving(launcher, &dir, s, budget, reserve, 100)?;
        broker.finish(Instant::now() + Duration::from_secs(10))?;
        Ok(info)
    })();
    std::fs::remove_dir_all(&dir).ok();
    r
}

/// A broker process and one engine process per model, started once and serving run after
/// run (as engines do in production: they are not restarted for each load): between runs the
/// driver sets each KV model's limit and guarantee at the broker, as an operator would
/// (`elastic-vmm ctl`), and every engine starts a run from no KV held.
pub struct Deployment {
    dir: PathBuf,
    sizes: DeploySizes,
    /// Whether its engines can sleep.
    sleeps: bool,
    broker: Option<Role>,
    engines: Vec<Role>,
    control: BrokerClient,
    reclaim_wait_ms: u64,
    runs: usize,
    /// A run failed half way: lines may be left in the engines' channels; no more runs.
    failed: bool,
}

impl Deployment {
    /// Start the broker (the budget `sizes.budget(k)`) and `k` engines, each loaded and
    /// warmed; ready when this returns. With `sleeps` runs may use sleep policies; where the
    /// budget holds fewer bases than `k` (`sizes.resident`), only they, and the engines load
    /// one by one, each asleep before the next.
    pub fn start(
        launcher: &Launcher,
        sizes: &DeploySizes,
        k: usize,
        reclaim_wait_ms: u64,
        sleeps: bool,
    ) -> Result<Deployment, String> {
        if k == 0 {
            return Err("a deployment with no models".into());
        }
        let one_by_one = sizes.resident < k;
        if one_by_one && !sleeps {
            return Err(format!(
                "{k} models with room for {} bases at once: only sleep policies serve them",
                sizes.resident
            ));
        }
        let dir = temp_dir()?;
        let started = (|| {
            let (broker, _) =
                start_broker(launcher, &dir, sizes, sizes.budget(k), reclaim_wait_ms)?;
            let socket = dir.join("broker.sock");
            let mut engines = Vec::with_capacity(k);
            for m in 0..k {
                // Until the first run sets them: the zero page and one mapped group (the
                // warm-up's block).
                let spec = EngineSpec {
                    socket: socket.clone(),
                    model: m,
                    sizes: sizes.clone(),
                    limit: sizes.zero_page + sizes.group_bytes,
                    guarantee: sizes.zero_page,
                    sleeps,
                };
                let path = dir.join(format!("engine-{m}.json"));
                write_json(&path, &spec)?;
                let mut role = launcher.spawn("engine", &path)?;
                role.name = format!("engine {m}");
                if one_by_one {
                    role.expect("ready", ready_wait(sizes))?;
                    role.send("sleep")?;
                    role.expect("asleep", ready_wait(sizes))?;
                }
                engines.push(role);
            }
            for role in engines.iter_mut().filter(|_| !one_by_one) {
                role.expect("ready", ready_wait(sizes))?;
            }
            let control = BrokerClient::connect_control(&socket, "serve-driver")
                .map_err(|e| e.to_string())?;
            Ok((broker, engines, control))
        })();
        match started {
            Ok((broker, engines, control)) => Ok(Deployment {
                dir,
                sizes: sizes.clone(),
                sleeps,
                broker: Some(broker),
                engines,
                control,
                reclaim_wait_ms,
                runs: 0,
                failed: false,
            }),
            Err(e) => {
                std::fs::remove_dir_all(&dir).ok();
                Err(e)
            }
        }
    }

    /// Set a KV model's limit or guarantee at the broker, as an operator does.
    fn set(&self, m: usize, limit: Option<u64>, guarantee: Option<u64>) -> Result<(), String> {
        use elastic_vmm::broker::protocol::{Reply, Request};
        let model = format!("model-{m}-kv");
        let request = match (limit, guarantee) {
            (Some(limit), _) => Request::SetLimit {
                model: model.clone(),
                limit,
                deadline_ms: 2000,
            },
            (None, Some(guarantee)) => Request::SetGuarantee {
                model: model.clone(),
                guarantee,
            },
            (None, None) => return Ok(()),
        };
        match self.control.request(request) {
            Ok((Reply::Changed(c), _))
                if limit.is_none_or(|l| c.limit == l)
                    && guarantee.is_none_or(|g| c.guarantee == g) =>
            {
                Ok(())
            }
            Ok((other, _)) => Err(format!(
                "{model}: limit {limit:?}, guarantee {guarantee:?} not set: {other:?}"
            )),
            Err(e) => Err(format!("{model}: {e}")),
        }
    }

    /// One run of `point` (its sizes and model count must be the deployment's).
    pub fn run(&mut self, point: &Point) -> Result<PointResult, String> {
        if self.failed {
            return Err("an earlier run of this deployment failed: start another".into());
        }
        // A point this deployment cannot run changes nothing.
        self.check(point)?;
        self.failed = true;
        let r = self.run_once(point);
        self.failed = r.is_err();
        r
    }

    /// Whether this deployment can run `point`: its sizes, model count and reclaim wait, and
    /// a policy its engines serve.
    fn check(&self, point: &Point) -> Result<(), String> {
        let s = &self.sizes;
        let k = self.engines.len();
        if point.requests.len() != k
            || point.sizes != *s
            || point.reclaim_wait_ms != self.reclaim_wait_ms
        {
            return Err(format!(
                "a run of {} models (sizes {}the deployment's, reclaim wait {} ms) on a deployment of {k} (reclaim wait {} ms)",
                point.requests.len(),
                if point.sizes == *s { "" } else { "not " },
                point.reclaim_wait_ms,
                self.reclaim_wait_ms
            ));
        }
        let (resident, sleeps) = (s.resident.clamp(1, k), point.policy.sleeps());
        if (sleeps && !self.sleeps) || (resident < k && !sleeps) {
            return Err(format!(
                "{}: a deployment of {k} models, {resident} resident, {}started for sleeps",
                point.policy.name(),
                if self.sleeps { "" } else { "not " }
            ));
        }
        Ok(())
    }

    fn run_once(&mut self, point: &Point) -> Result<PointResult, String> {
        let wall = Instant::now();
        let s = &self.sizes;
        let k = self.engines.len();
        let resident = s.resident.clamp(1, k);
        // Shares in whole mapped groups, so that the static limits sum to at most the budget.
        let g = s.group_blocks.max(1) as usize;
        let total = s.kv_blocks as usize;
        let groups = match point.policy {
            DeployPolicy::StaticEqual => vec![total / g / k; k],
            DeployPolicy::StaticBest => {
                let longest = s.engine.max_context.div_ceil(s.block_tokens) as usize;
                static_shares(total / g, &point.demand, longest.div_ceil(g))
            }
            // A share of every resident model's, held only while awake.
            DeployPolicy::StaticSleep => vec![total / g / resident; k],
            DeployPolicy::Elastic | DeployPolicy::ElasticSleep => vec![total / g; k],
        };
        let shares: Vec<usize> = groups.iter().map(|n| n * g).collect();
        // Each KV model's limit, and the guarantee the driver sets (a sleeping model's is its
        // zero page: it raises its own while awake).
        let limits: Vec<(u64, u64)> = shares
            .iter()
            .map(|&n| {
                let share = s.kv_bytes(n as u64) + s.zero_page;
                match point.policy {
                    DeployPolicy::StaticEqual | DeployPolicy::StaticBest => (share, share),
                    _ => (share, s.zero_page),
                }
            })
            .collect();
        // Every engine holds only its zero page now: guarantees down first, then limits,
        // then guarantees up, so that no step is refused for the sum.
        for m in 0..k {
            self.set(m, None, Some(s.zero_page))?;
        }
        for (m, &(limit, _)) in limits.iter().enumerate() {
            self.set(m, Some(limit), None)?;
        }
        for (m, &(_, guarantee)) in limits.iter().enumerate() {
            self.set(m, None, Some(guarantee))?;
        }
        let end_s = point.duration_s + point.drain_s;
        let run = self.runs;
        self.runs += 1;
        let mut outs = Vec::with_capacity(k);
        for (m, reqs) in point.requests.iter().enumerate() {
            let spec = RunSpec {
                cap_blocks: shares[m],
                fair_blocks: total / resident,
                end_s,
                requests: reqs.clone(),
                out: self.dir.join(format!("run-{run}-engine-{m}.out.json")),
                sleep: point.policy.sleeps().then_some(SleepSpec {
                    idle_s: point.sleep_idle_s,
                    kv_guarantee: match point.policy {
                        DeployPolicy::StaticSleep => s.kv_bytes(shares[m] as u64) + s.zero_page,
                        _ => s.zero_page,
                    },
                }),
            };
            let path = self.dir.join(format!("run-{run}-engine-{m}.json"));
            write_json(&path, &spec)?;
            self.engines[m].send(&format!("run {}", path.display()))?;
            outs.push(spec.out);
        }
        for role in self.engines.iter_mut() {
            role.expect("armed", READY_WAIT)?;
        }
        // Every run starts from the same state: the chunks the last run and the engines'
        // arming (a sleep policy's sleeps) gave back are released, not waiting idle at the
        // broker for a hand-over.
        match self
            .control
            .request(elastic_vmm::broker::protocol::Request::Trim)
        {
            Ok((elastic_vmm::broker::protocol::Reply::Trimmed { .. }, _)) => {}
            Ok((other, _)) => return Err(format!("trim at the broker: {other:?}")),
            Err(e) => return Err(format!("trim at the broker: {e}")),
        }
        // Every engine gets the same start instant, a little ahead (they read it at once).
        let start = monotonic_ns() + 20_000_000;
        for role in self.engines.iter_mut() {
            role.send(&format!("start {start}"))?;
        }
        let wait = Duration::from_secs_f64(end_s + 30.0);
        let mut reports = Vec::with_capacity(k);
        for (role, out) in self.engines.iter_mut().zip(&outs) {
            role.expect("done", wait)?;
            reports.push(read_json::<EngineReport>(out)?);
        }
        Ok(PointResult {
            engines: reports,
            end_s,
            wall_s: wall.elapsed().as_secs_f64(),
        })
    }

    /// The broker's view of every model and its counters.
    pub fn snapshot(&self) -> Result<elastic_vmm::broker::protocol::Snapshot, String> {
        self.control.snapshot().map_err(|e| e.to_string())
    }

    /// Stop the engines (their input ends), then the broker.
    pub fn stop(mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut failed = Vec::new();
        for role in std::mem::take(&mut self.engines) {
            let name = role.name.clone();
            if let Err(e) = role.finish(deadline) {
                failed.push(format!("{name}: {e}"));
            }
        }
        if let Some(b) = self.broker.take() {
            if let Err(e) = b.finish(Instant::now() + Duration::from_secs(30)) {
                failed.push(e);
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(failed.join("; "))
        }
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        // Roles left (an error half way) are killed by their own drop.
        std::fs::remove_dir_all(&self.dir).ok();
    }
}
