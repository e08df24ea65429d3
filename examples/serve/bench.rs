//! `serve bench`: the process deployment (`deploy.rs`) swept over load points, seeds (trace
//! windows) and policies, every request counted (`metrics.rs`).
//!
//! ```text
//! serve bench [--models K] [--policies static-equal,static-best,elastic] [--loads 0.5,1,1.5]
//!             [--seeds 1,2,3,4,5] [--duration S] [--drain S] [--traces conv,code,mooncake]
//!             [--traces-dir DIR] [--len-scale F] [--kv-blocks B] [--slo-ttft S]
//!             [--slo-tpot S] [--reclaim-wait-ms MS] [--out DIR]
//!             [--resident R] [--sleep-after S] [--on-off ON,OFF] [--rate R]
//!             [--gpu small|8b [--budget-gib G] [--reserve-gib G] [--act-reserve-gib G]
//!              [--cost-ms STEP,SEQ,PREFILL[,CTX]] [--max-batch N] [--max-context N] [--prefill-chunk N]
//!              [--block-shape token-major|head-major|split-k]]
//! ```
//!
//! With `--gpu` the engines are candle Llamas on CUDA device 0 (see `deploy.rs`); lengths
//! are the traces' own (`--len-scale 1`), the TPOT SLO 100 ms, contexts up to 4,096 tokens
//! (longer requests are cut to it, as `workload.rs` does for every source), batches of up to
//! 64. The budget is the
//! device's free memory less `--reserve-gib` (default 1.5) per engine, or `--budget-gib`;
//! each model's base is its weights and `--act-reserve-gib` (8B: 2.5, small: 1); the KV
//! budget is the rest. `--cost-ms` is the cost model of one engine alone, in ms: per decode
//! step, per sequence in it, per prefill token, and per context token a decode reads
//! (optional, 0 without it). `serve probe --gpu 8b` measures them on the machine and prints
//! the line to pass; the defaults (8B: 8 ms a step, 0.14 ms a sequence from `gpu-bench
//! attention`, 0.14 ms a prefill token from the first serve run, when decode still gathered
//! its blocks) only stand in where no probe ran. The costs are multiplied by the models
//! because the engines share the device's compute. `--cost-ms` and `--max-batch` apply to
//! the host simulation too, so that it can stand in for a GPU run: its engines then take
//! turns on one simulated device, each step costing what one engine alone takes (its blocks
//! are of 32 tokens: `--kv-blocks` half the GPU's 16-token count).
//!
//! Sleep policies (`static-sleep`, `elastic-sleep`; see `deploy.rs`): a model with no work
//! for `--sleep-after` seconds (default 1) sleeps, its base copied to host memory and its
//! guarantees given back; a request wakes it, the wake inside its TTFT. `--resident R` sizes
//! the budget for R models' bases (default: every model's); with fewer than `--models` only
//! sleep policies run, and the engines load one by one, each asleep before the next.
//! `--on-off ON,OFF` keeps each model's requests to bursts of ON seconds followed by OFF idle
//! (Prism-like; the models' bursts spread over the cycle; the load is the rate inside a
//! burst, the mean ON/(ON+OFF) of it); `--rate R` sets load 1.0 to R
//! requests/s per model instead of the nominal capacity, so that sweeps over the model count
//! offer each model the same traffic.
//!
//! `--reclaim-wait-ms` (default 200) is the broker's `reclaim_wait`: how long a growth the
//! budget cannot take waits for other engines to give memory back before it is refused.
//! Elastic runs are sensitive to it: on the host, two engines growing at once have each
//! waited for the other's give-back until this deadline (see the report of issue 32's work).
//!
//! Load 1.0 is the nominal capacity of a static split: the lower of two rates per model. The
//! rate at which the models' mean KV demand (Little's law: rate x `(prompt + output / 2) *
//! output` tokens held for one decode step each, over each model's whole trace at the scaled
//! lengths) fills the whole KV budget, at the cost model's decode step for the batch a static
//! share holds; and the rate at which a mean request's compute (its prompt's prefill, its
//! output's decode at that batch) keeps its engine busy. The
//! knee is then measured: the load at which the best static policy's mean SLO attainment falls
//! below 99%. Runs go seed by seed, load by load, the policies' order rotated per seed.
//!
//! Output under `--out`: `runs/<load>-<policy>-s<seed>.json` (every record, the engines'
//! counters, the command, commit and machine), `table.txt` (per load, per policy: mean and
//! 95% confidence interval of each metric over the seeds), `summary.json`, and
//! `slo-attainment.svg` (SLO attainment against load with confidence bands per policy).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::deploy::{self, DeployPolicy, DeploySizes, Launcher, Point, PointResult};
use crate::metrics::{self, RunStats, Slo};
use crate::report;
use crate::trace::Request;
use crate::workload::{self, Lengths, Source};

/// The sweep's settings.
#[derive(Debug, Clone)]
pub struct BenchArgs {
    /// Models (engine processes).
    pub models: usize,
    /// Policies.
    pub policies: Vec<DeployPolicy>,
    /// Load points (multiples of the nominal static capacity).
    pub loads: Vec<f64>,
    /// Seeds (trace windows).
    pub seeds: Vec<u64>,
    /// Seconds of trace.
    pub duration_s: f64,
    /// Seconds after it.
    pub drain_s: f64,
    /// Trace sources, cycled over the models.
    pub sources: Vec<Source>,
    /// Where the real traces are.
    pub traces_dir: PathBuf,
    /// Factor on lengths.
    pub len_scale: f64,
    /// KV blocks per model (the KV budget is this times the models).
    pub kv_blocks_per_model: u64,
    /// The SLO.
    pub slo: Slo,
    /// The broker's reclaim wait (milliseconds).
    pub reclaim_wait_ms: u64,
    /// Output folder.
    pub out: PathBuf,
    /// Real engines on the GPU: the model size (`small`, `8b`); `None`: simulated compute.
    pub gpu: Option<String>,
    /// GPU: the broker's budget (bytes); `None`: the device's free memory less `reserve`.
    pub budget: Option<u64>,
    /// GPU: bytes per engine left outside the budget (its CUDA context, cuBLAS workspace).
    pub reserve_per_engine: u64,
    /// GPU: activation bytes reserved per model (its base is its weights and this).
    pub act_reserve: Option<u64>,
    /// GPU: the cost model for the nominal load, seconds per decode step, per sequence in it,
    /// per prefill token and per context token a decode reads, one engine alone on the
    /// device (`serve probe` measures them).
    pub cost: Option<[f64; 4]>,
    /// GPU: engine limits.
    pub max_batch: usize,
    /// GPU: longest context.
    pub max_context: u32,
    /// GPU: most tokens in one prefill forward.
    pub prefill_chunk: usize,
    /// GPU: the KV cache's block order (`--block-shape`, see `llama::parse_block_shape`).
    pub block_shape: String,
    /// Models whose bases the budget holds at once (`None`: all; fewer: sleep policies only).
    pub resident: Option<usize>,
    /// Sleep policies: seconds with no work after which a model sleeps.
    pub sleep_idle_s: f64,
    /// Prism-like idle periods: each model's requests only in bursts of `.0` seconds, then
    /// `.1` seconds idle, the bursts spread over the cycle.
    pub on_off: Option<(f64, f64)>,
    /// Load 1.0's rate per model (requests/s) as given, instead of the nominal capacity.
    pub rate: Option<f64>,
}

impl BenchArgs {
    /// Defaults (`out` as given): 3 models, all three policies, loads 0.5, 1, 1.5, five seeds,
    /// 20 s traces and 5 s drain, the Azure conversation and code traces and Mooncake, lengths
    /// at a quarter (the host simulation's KV budget is small), 192 KV blocks per model, an
    /// SLO of 1 s TTFT and 50 ms TPOT.
    pub fn defaults(out: PathBuf) -> BenchArgs {
        BenchArgs {
            models: 3,
            policies: vec![
                DeployPolicy::StaticEqual,
                DeployPolicy::StaticBest,
                DeployPolicy::Elastic,
            ],
            loads: vec![0.5, 1.0, 1.5],
            seeds: vec![1, 2, 3, 4, 5],
            duration_s: 20.0,
            drain_s: 5.0,
            sources: vec![Source::AzureConv, Source::AzureCode, Source::Mooncake],
            traces_dir: default_traces_dir(),
            len_scale: 0.25,
            kv_blocks_per_model: 192,
            slo: Slo {
                ttft_s: 1.0,
                tpot_s: 0.05,
            },
            reclaim_wait_ms: 200,
            out,
            gpu: None,
            budget: None,
            reserve_per_engine: 3 << 29,
            act_reserve: None,
            cost: None,
            max_batch: 64,
            max_context: 4096,
            prefill_chunk: 512,
            block_shape: "token-major".into(),
            resident: None,
            sleep_idle_s: 1.0,
            on_off: None,
            rate: None,
        }
    }

    /// Parse `bench`'s flags.
    pub fn parse(argv: &[String], out: PathBuf) -> Result<BenchArgs, String> {
        let mut a = BenchArgs::defaults(out);
        // On the GPU, real lengths (the host simulation's KV budget is small).
        if let Some(i) = argv.iter().position(|f| f == "--gpu") {
            a.len_scale = 1.0;
            a.slo.tpot_s = 0.1;
            a.gpu = argv.get(i + 1).cloned();
        }
        let mut i = 0;
        while i < argv.len() {
            let flag = argv[i].as_str();
            if flag == "--sim" {
                i += 1;
                continue;
            }
            let v = argv
                .get(i + 1)
                .ok_or_else(|| format!("{flag} needs a value"))?;
            let num = |v: &str| {
                v.parse::<f64>()
                    .map_err(|_| format!("{flag}: bad number {v:?}"))
            };
            let list = |v: &str| -> Result<Vec<String>, String> {
                Ok(v.split(',').map(|x| x.trim().to_string()).collect())
            };
            match flag {
                "--models" => a.models = num(v)? as usize,
                "--policies" => {
                    a.policies = list(v)?
                        .iter()
                        .map(|p| DeployPolicy::parse(p))
                        .collect::<Result<_, _>>()?
                }
                "--loads" => a.loads = list(v)?.iter().map(|x| num(x)).collect::<Result<_, _>>()?,
                "--seeds" => {
                    a.seeds = list(v)?
                        .iter()
                        .map(|x| x.parse().map_err(|_| format!("--seeds: bad seed {x:?}")))
                        .collect::<Result<_, _>>()?
                }
                "--duration" => a.duration_s = num(v)?,
                "--drain" => a.drain_s = num(v)?,
                "--traces" => {
                    a.sources = list(v)?
                        .iter()
                        .map(|s| Source::parse(s))
                        .collect::<Result<_, _>>()?
                }
                "--traces-dir" => a.traces_dir = PathBuf::from(v),
                "--len-scale" => a.len_scale = num(v)?,
                "--kv-blocks" => a.kv_blocks_per_model = num(v)? as u64,
                "--slo-ttft" => a.slo.ttft_s = num(v)?,
                "--slo-tpot" => a.slo.tpot_s = num(v)?,
                "--reclaim-wait-ms" => a.reclaim_wait_ms = num(v)? as u64,
                "--out" => a.out = PathBuf::from(v),
                "--gpu" => a.gpu = Some(v.clone()),
                "--budget-gib" => a.budget = Some(gib(num(v)?)?),
                "--reserve-gib" => a.reserve_per_engine = gib(num(v)?)?,
                "--act-reserve-gib" => a.act_reserve = Some(gib(num(v)?)?),
                "--cost-ms" => {
                    let c = list(v)?
                        .iter()
                        .map(|x| num(x))
                        .collect::<Result<Vec<_>, _>>()?;
                    let c = match c[..] {
                        [step, seq, prefill] => [step, seq, prefill, 0.0],
                        [step, seq, prefill, ctx] => [step, seq, prefill, ctx],
                        _ => [f64::NAN; 4],
                    };
                    if !(c[0] > 0.0 && c[1..].iter().all(|x| *x >= 0.0)) {
                        return Err(format!(
                            "--cost-ms: STEP,SEQ,PREFILL_TOKEN[,CONTEXT_TOKEN] in ms, the step above 0 and none below, got {v:?}"
                        ));
                    }
                    a.cost = Some(c.map(|x| x / 1e3));
                }
                "--max-batch" => a.max_batch = num(v)? as usize,
                "--max-context" => a.max_context = num(v)? as u32,
                "--prefill-chunk" => a.prefill_chunk = num(v)? as usize,
                "--block-shape" => a.block_shape = v.to_string(),
                "--resident" => a.resident = Some(num(v)? as usize),
                "--sleep-after" => a.sleep_idle_s = num(v)?,
                "--rate" => a.rate = Some(num(v)?),
                "--on-off" => {
                    let c = list(v)?
                        .iter()
                        .map(|x| num(x))
                        .collect::<Result<Vec<_>, _>>()?;
                    match c[..] {
                        [on, off] if on > 0.0 && off >= 0.0 => a.on_off = Some((on, off)),
                        _ => {
                            return Err(format!("--on-off: ON,OFF seconds, ON above 0, got {v:?}"))
                        }
                    }
                }
                _ => return Err(format!("bench: unknown flag {flag} (see bench.rs)")),
            }
            i += 2;
        }
        let bad = a.models == 0
            || a.policies.is_empty()
            || a.seeds.is_empty()
            || a.sources.is_empty()
            || a.kv_blocks_per_model == 0
            || !(a.duration_s > 0.0 && a.drain_s >= 0.0 && a.len_scale > 0.0)
            || !a.loads.iter().all(|l| *l > 0.0);
        if bad {
            return Err("bench: models, policies, seeds, traces, KV blocks, duration, length scale and loads must be positive".into());
        }
        let (idle_ok, rate_ok) = (
            a.sleep_idle_s.is_finite() && a.sleep_idle_s >= 0.0,
            a.rate.is_none_or(|r| r.is_finite() && r > 0.0),
        );
        if !idle_ok || !rate_ok {
            return Err(format!(
                "bench: --sleep-after {} must be at least 0 and --rate {:?} above 0",
                a.sleep_idle_s, a.rate
            ));
        }
        match a.resident {
            Some(r) if r == 0 || r > a.models => {
                return Err(format!(
                    "bench: --resident {r} must be from 1 to --models {}",
                    a.models
                ))
            }
            Some(r) if r < a.models && a.policies.iter().any(|p| !p.sleeps()) => {
                return Err(format!(
                    "bench: with --resident {r} below --models {} only sleep policies (static-sleep, elastic-sleep) serve every model",
                    a.models
                ))
            }
            _ => {}
        }
        Ok(a)
    }

    /// The deployment's sizes; on the GPU with no KV budget yet (see [`run`]).
    fn sizes(&self) -> Result<DeploySizes, String> {
        let Some(size) = &self.gpu else {
            let small = DeploySizes::small(self.models);
            // `--cost-ms` and `--max-batch` apply to the simulation too, so that it can stand
            // in for a GPU run: its cost model from `serve probe`, the engines taking turns on
            // one simulated device (each step costs what one engine alone takes, and waits
            // while another engine's step runs). The nominal load counts every cost times the
            // resident models, as on the GPU.
            let cost = self.cost.map_or(small.cost, |[step, seq, prefill, ctx]| {
                let k = self.resident() as f64;
                crate::engine::SimCost {
                    step_s: step * k,
                    prefill_token_s: prefill * k,
                    decode_seq_s: seq * k,
                    context_token_s: ctx * k,
                }
            });
            return Ok(DeploySizes {
                kv_blocks: self.kv_blocks_per_model * self.resident() as u64,
                resident: self.resident(),
                shared_device: self.cost.is_some(),
                cost,
                engine: crate::engine::EngineConfig {
                    max_batch: self.max_batch,
                    ..small.engine
                },
                ..small
            });
        };
        gpu_sizes(self, size)
    }

    /// Models whose bases the budget holds at once.
    fn resident(&self) -> usize {
        self.resident.unwrap_or(self.models)
    }

    fn lengths(&self) -> Lengths {
        Lengths {
            scale: self.len_scale,
            max_len: if self.gpu.is_some() {
                self.max_context
            } else {
                DeploySizes::small(1).engine.max_context
            },
        }
    }
}

fn gib(g: f64) -> Result<u64, String> {
    if g.is_finite() && g > 0.0 && g < 1e6 {
        Ok((g * (1u64 << 30) as f64) as u64)
    } else {
        Err(format!("{g} GiB is not a size"))
    }
}

/// Sizes of real engines of `size` on the GPU (2 MiB granules; the KV budget set later).
#[cfg(feature = "candle-example")]
fn gpu_sizes(a: &BenchArgs, size: &str) -> Result<DeploySizes, String> {
    // A bad order is refused here, before any engine starts.
    crate::llama::parse_block_shape(&a.block_shape)?;
    use crate::engine::{EngineConfig, SimCost};
    use crate::llama::Size;
    use crate::paged_llama::BLOCK_TOKENS;
    let z = Size::parse(size)?;
    const PAGE: u64 = 2 << 20;
    let block = z.block_bytes();
    let layer_tensors = 2 * z.config().layers as u64;
    // One page of every layer's K and V holds this many blocks.
    let per_page = (PAGE / (block / layer_tensors)).max(1);
    // Measured on the H100 (docs/results): an 8B decode step ~8 ms alone plus ~0.14 ms per
    // sequence at 2K context (`gpu-bench attention`), and ~7 K prefill tokens/s on the whole
    // device (`serve-bench/h100-8b-first`); the small model guessed at a fifth of that.
    let [step, seq, prefill, ctx] = a.cost.unwrap_or(match z {
        Size::Llama8B => [8e-3, 0.14e-3, 0.14e-3, 0.0],
        Size::Small => [1.5e-3, 0.02e-3, 0.03e-3, 0.0],
    });
    let act = a.act_reserve.unwrap_or(match z {
        Size::Llama8B => 5 << 29,
        Size::Small => 1 << 30,
    });
    let k = a.resident() as f64;
    Ok(DeploySizes {
        granularity: PAGE,
        resident: a.resident(),
        block_tokens: BLOCK_TOKENS as u32,
        group_blocks: per_page,
        group_bytes: per_page * block,
        weights: z.weight_bytes(),
        act_reserve: act,
        zero_page: PAGE,
        act_bytes_per_token: 0,
        kv_blocks: 0,
        engine: EngineConfig {
            max_batch: a.max_batch,
            max_prefill_tokens: a.prefill_chunk.max(1) as u32 * 4,
            max_context: a.max_context,
        },
        // The engines share the device's compute (time-sliced): with all of them busy a step
        // takes K times as long (K the models awake at once).
        cost: SimCost {
            step_s: step * k,
            prefill_token_s: prefill * k,
            decode_seq_s: seq * k,
            context_token_s: ctx * k,
        },
        gpu: Some(deploy::GpuEngines {
            size: size.to_string(),
            prefill_chunk: a.prefill_chunk,
            block_shape: a.block_shape.clone(),
        }),
        shared_device: false,
    })
}

#[cfg(not(feature = "candle-example"))]
fn gpu_sizes(_: &BenchArgs, _: &str) -> Result<DeploySizes, String> {
    Err("--gpu: built without the candle-example feature".into())
}

/// `../shared/traces` beside the repository (the crate's root is known at build time).
pub fn default_traces_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces")
}

/// What each model's trace is made from.
enum Feed {
    /// Rows of a real trace.
    Real(Vec<workload::Row>),
    /// The generator.
    Synthetic,
}

/// A model's feed and what it asks per request on average.
struct FeedStats {
    feed: Feed,
    /// KV demand (token-steps).
    demand: f64,
    /// Context over the decode.
    context: f64,
    /// Prompt and output tokens.
    lengths: (f64, f64),
}

/// The models' feeds and their means per request.
fn feeds(a: &BenchArgs) -> Result<Vec<FeedStats>, String> {
    let len = a.lengths();
    let mut out = Vec::new();
    for m in 0..a.models {
        let src = a.sources[m % a.sources.len()];
        let feed = match src {
            Source::Synthetic => {
                let reqs = workload::synthetic(a.models, 0, 1.0, 600.0, len)?;
                let r = &reqs[m];
                FeedStats {
                    feed: Feed::Synthetic,
                    demand: workload::demand_per_request(r),
                    context: workload::mean_context(r),
                    lengths: workload::mean_lengths(r),
                }
            }
            _ => {
                let rows = workload::load(&a.traces_dir, src)?;
                let (span, _) = workload::span_rate(&rows);
                let all = workload::window(&rows, m, 0, rows.len() as f64 / span, span, len);
                FeedStats {
                    demand: workload::demand_per_request(&all),
                    context: workload::mean_context(&all),
                    lengths: workload::mean_lengths(&all),
                    feed: Feed::Real(rows),
                }
            }
        };
        out.push(feed);
    }
    Ok(out)
}

/// The rate per model (requests/s) at load 1.0: see the module docs.
/// The two rates per model whose lower is load 1.0: `(memory, compute)` (requests/s), the
/// one at which the mean KV demand fills the budget and the one at which a mean request's
/// compute keeps its engine busy (infinite where the cost model prices nothing).
fn bound_rates(a: &BenchArgs, s: &DeploySizes, feeds: &[FeedStats]) -> (f64, f64) {
    let demands: Vec<f64> = feeds.iter().map(|f| f.demand).collect();
    let contexts: Vec<f64> = feeds.iter().map(|f| f.context).collect();
    let kv_tokens = s.kv_blocks as f64 * s.block_tokens as f64;
    let share_tokens = kv_tokens / a.resident() as f64;
    let mean_ctx = (contexts.iter().sum::<f64>() / contexts.len().max(1) as f64).max(1.0);
    let batch = (share_tokens / mean_ctx).clamp(1.0, s.engine.max_batch as f64);
    let step = s.cost.step_s + (s.cost.decode_seq_s + s.cost.context_token_s * mean_ctx) * batch;
    let memory = kv_tokens / (step * demands.iter().sum::<f64>().max(1e-9));
    // Compute: the time a mean request takes of its engine (its prefill, its decode at that
    // batch; on the GPU the costs are already those of K engines sharing the device); the
    // lower bound is the nominal capacity.
    let k = feeds.len().max(1) as f64;
    let (p, o) = feeds.iter().fold((0.0, 0.0), |(p, o), f| {
        (p + f.lengths.0 / k, o + f.lengths.1 / k)
    });
    let per_request = p * s.cost.prefill_token_s + o * step / batch;
    let compute = if per_request > 0.0 {
        1.0 / per_request
    } else {
        f64::INFINITY
    };
    (memory, compute)
}

fn requests(
    a: &BenchArgs,
    feeds: &[FeedStats],
    seed: u64,
    rate: f64,
) -> Result<Vec<Vec<Request>>, String> {
    let len = a.lengths();
    let mut synth: Option<Vec<Vec<Request>>> = None;
    let mut out = Vec::new();
    for (m, FeedStats { feed, .. }) in feeds.iter().enumerate() {
        let mut reqs = match feed {
            Feed::Real(rows) => {
                let w = workload::window(rows, m, seed, rate, a.duration_s, len);
                let asked = (rate * a.duration_s).round();
                if (w.len() as f64) < asked {
                    return Err(format!(
                        "model {m}'s trace has {} requests, fewer than the {asked} a rate of {rate:.3}/s for {} s asks: shorten --duration or lower the load",
                        w.len(),
                        a.duration_s
                    ));
                }
                w
            }
            Feed::Synthetic => {
                if synth.is_none() {
                    synth = Some(workload::synthetic(
                        a.models,
                        seed,
                        rate,
                        a.duration_s,
                        len,
                    )?);
                }
                synth.as_ref().map(|s| s[m].clone()).unwrap_or_default()
            }
        };
        if let Some((on, off)) = a.on_off {
            reqs = workload::bursts(reqs, m, a.models, on, off);
        }
        out.push(reqs);
    }
    Ok(out)
}

/// One run as saved.
#[derive(Debug, Clone, Serialize)]
pub struct RunFile {
    /// The command line.
    pub command: String,
    /// The commit it was built from.
    pub commit: String,
    /// The machine.
    pub machine: String,
    /// Policy.
    pub policy: String,
    /// Load point.
    pub load: f64,
    /// Mean rate per model (requests/s).
    pub rate: f64,
    /// Seed (trace window).
    pub seed: u64,
    /// Traces per model.
    pub traces: Vec<String>,
    /// The SLO.
    pub slo: Slo,
    /// Seconds of trace, and of drain.
    pub duration_s: f64,
    /// Drain.
    pub drain_s: f64,
    /// The broker's reclaim wait (milliseconds).
    pub reclaim_wait_ms: u64,
    /// All models.
    pub stats: RunStats,
    /// Per model.
    pub per_model: Vec<RunStats>,
    /// The deployment's sizes (budget, KV blocks, bases, cost model, engine limits).
    pub sizes: DeploySizes,
    /// The broker's device (GPU runs).
    pub device: Option<deploy::BrokerInfo>,
    /// The engines' reports (every record).
    pub result: PointResult,
}

/// The commit of the source tree the binary was built in, `+dirty` with changes not
/// committed (`unknown` without git there, as in a bundle on a GPU machine).
fn commit() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(["-C", env!("CARGO_MANIFEST_DIR")])
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "HEAD"]) {
        Some(head)
            if git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty()) =>
        {
            format!("{head}+dirty")
        }
        Some(head) => head,
        None => "unknown".into(),
    }
}

fn machine(gpu: Option<&deploy::BrokerInfo>) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    match gpu {
        None => format!(
            "{} ({cpus} CPUs): host backend, simulated compute",
            host.trim()
        ),
        Some(i) => format!(
            "{} ({cpus} CPUs): {}, {:.2} GiB, {:.2} GiB free at the probe; candle engines",
            host.trim(),
            i.device,
            i.total as f64 / GIB,
            i.free as f64 / GIB
        ),
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// Mean and CI of each metric per (load, policy).
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    /// Load point.
    pub load: f64,
    /// Policy.
    pub policy: String,
    /// Runs (seeds).
    pub runs: usize,
    /// (metric, mean, 95% CI half-width).
    pub metrics: Vec<(String, f64, f64)>,
}

/// The sweep's summary.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The command line.
    pub command: String,
    /// Commit.
    pub commit: String,
    /// Machine.
    pub machine: String,
    /// The SLO.
    pub slo: Slo,
    /// Rate per model at load 1.0.
    pub nominal_rate: f64,
    /// Cells.
    pub cells: Vec<Cell>,
    /// The knee (load at which the best static policy's SLO attainment falls below 99%).
    pub knee: Option<f64>,
}

/// Summarise `runs` (load, policy, stats).
pub fn summarise(runs: &[(f64, String, RunStats)]) -> (Vec<Cell>, Option<f64>) {
    let mut keys: Vec<(f64, String)> = Vec::new();
    for (l, p, _) in runs {
        if !keys.iter().any(|(kl, kp)| kl == l && kp == p) {
            keys.push((*l, p.clone()));
        }
    }
    keys.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    let cells: Vec<Cell> = keys
        .into_iter()
        .map(|(load, policy)| {
            let of: Vec<&RunStats> = runs
                .iter()
                .filter(|(l, p, _)| *l == load && *p == policy)
                .map(|r| &r.2)
                .collect();
            let names = RunStats::default().metrics().map(|m| m.0);
            let metrics = names
                .iter()
                .enumerate()
                .map(|(i, n)| {
                    let v: Vec<f64> = of.iter().map(|s| s.metrics()[i].1).collect();
                    let (m, ci) = metrics::mean_ci(&v);
                    (n.to_string(), m, ci)
                })
                .collect();
            Cell {
                load,
                policy,
                runs: of.len(),
                metrics,
            }
        })
        .collect();
    // The best static policy at each load: the most attainment of the static splits (whole
    // models swapped, `static-sleep`, is another deployment).
    let mut best: Vec<(f64, f64)> = Vec::new();
    let split = |p: &str| matches!(p, "static-equal" | "static-best");
    for c in cells.iter().filter(|c| split(&c.policy)) {
        let att = c.metrics[0].1;
        match best.iter_mut().find(|b| b.0 == c.load) {
            Some(b) => b.1 = b.1.max(att),
            None => best.push((c.load, att)),
        }
    }
    let knee = metrics::knee(&best, 0.99);
    (cells, knee)
}

/// One run's models: each model's trace and its stats, with the run's load and policy.
pub type PerModel = (f64, String, Vec<(String, RunStats)>);

/// Where the misses come from: per load and policy, each model's SLO attainment (mean ± 95%
/// CI over seeds), headed by its trace. Empty without per-model stats.
pub fn per_model_table(per: &[PerModel]) -> String {
    let mut keys: Vec<(f64, &str)> = Vec::new();
    for (l, p, _) in per {
        if !keys.iter().any(|(kl, kp)| kl == l && kp == p) {
            keys.push((*l, p));
        }
    }
    if per.iter().all(|r| r.2.is_empty()) {
        return String::new();
    }
    keys.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(b.1)));
    let mut out =
        String::from("\nSLO attainment per model (its trace), mean ± 95% CI over seeds\n");
    let mut last = f64::NAN;
    for (load, policy) in keys {
        let runs: Vec<&Vec<(String, RunStats)>> = per
            .iter()
            .filter(|r| r.0 == load && r.1 == policy)
            .map(|r| &r.2)
            .collect();
        let models = runs.iter().map(|r| r.len()).max().unwrap_or(0);
        if load != last {
            last = load;
            let _ = write!(out, "\nload {load:<6} {:<13}", "policy");
            for m in 0..models {
                let name = runs
                    .iter()
                    .find_map(|r| r.get(m))
                    .map_or("?", |x| x.0.as_str());
                let _ = write!(out, " {:>17}", format!("{m} {name}"));
            }
            out.push('\n');
        }
        let _ = write!(out, "{:<11} {policy:<13}", "");
        for m in 0..models {
            let v: Vec<f64> = runs
                .iter()
                .filter_map(|r| r.get(m))
                .map(|x| x.1.slo_attainment)
                .collect();
            let (mean, ci) = metrics::mean_ci(&v);
            let _ = write!(out, " {:>17}", format!("{mean:.3}±{ci:.3}"));
        }
        out.push('\n');
    }
    out
}

/// The table: per load, a line per policy with each metric's mean ± CI.
pub fn table(cells: &[Cell], slo: &Slo) -> String {
    let mut out = format!(
        "SLO: TTFT <= {} s and mean TPOT <= {} s; mean ± 95% CI over seeds; percentiles over all requests (censored at the run's end)\n",
        slo.ttft_s, slo.tpot_s
    );
    let mut last = f64::NAN;
    for c in cells {
        if c.load != last {
            last = c.load;
            let _ = write!(out, "\nload {:<6} {:<13} {:>4}", c.load, "policy", "runs");
            for (n, _, _) in &c.metrics {
                let _ = write!(out, " {n:>17}");
            }
            out.push('\n');
        }
        let _ = write!(out, "{:<11} {:<13} {:>4}", "", c.policy, c.runs);
        for (_, m, ci) in &c.metrics {
            let _ = write!(out, " {:>17}", format!("{m:.3}±{ci:.3}"));
        }
        out.push('\n');
    }
    out
}

/// SLO attainment against load with 95% bands, per policy.
pub fn attainment_svg(cells: &[Cell], slo: &Slo) -> String {
    let mut series: Vec<report::BandSeries> = Vec::new();
    for c in cells {
        let (_, m, ci) = c.metrics[0];
        let ci = if ci.is_finite() { ci } else { 0.0 };
        let p = (c.load, m, (m - ci).max(0.0), (m + ci).min(1.0));
        match series.iter_mut().find(|s| s.0 == c.policy) {
            Some(s) => s.1.push(p),
            None => series.push((c.policy.clone(), vec![p])),
        }
    }
    report::band_chart(
        &format!(
            "SLO attainment (TTFT <= {} s, TPOT <= {} s), 95% CI",
            slo.ttft_s, slo.tpot_s
        ),
        "load (x nominal static capacity)",
        "SLO attainment",
        &series,
        false,
    )
}

/// Run the sweep with `launcher` starting the roles.
pub fn run(a: &BenchArgs, launcher: &Launcher, command: &str) -> Result<Summary, String> {
    let feeds = feeds(a)?;

    let mut sizes = a.sizes()?;
    let mut gpu = None;
    if sizes.gpu.is_some() {
        // The KV budget: what the device has (or --budget-gib) less the models' bases.
        let reserve = a.reserve_per_engine.saturating_mul(a.models as u64);
        let info = deploy::probe_budget(launcher, &sizes, reserve)?;
        let budget = a.budget.unwrap_or(info.budget);
        if budget > info.budget {
            return Err(format!(
                "--budget-gib {:.2} is more than the device's free memory less the engines' reserve ({:.2} GiB)",
                budget as f64 / GIB,
                info.budget as f64 / GIB
            ));
        }
        let bases = sizes.bases(a.models);
        let groups = budget.saturating_sub(bases) / sizes.group_bytes.max(1);
        sizes.kv_blocks = groups * sizes.group_blocks;
        if sizes.kv_blocks == 0 {
            return Err(format!(
                "a budget of {:.2} GiB leaves no KV beside {} bases of {:.2} GiB",
                budget as f64 / GIB,
                a.models,
                sizes.base() as f64 / GIB
            ));
        }
        println!(
            "bench: {} on the GPU: budget {:.2} GiB = {} x {:.2} GiB bases (weights {:.2}) + {:.2} GiB of KV ({} blocks of {} tokens)",
            info.device,
            (bases + sizes.kv_bytes(sizes.kv_blocks)) as f64 / GIB,
            a.resident(),
            sizes.base() as f64 / GIB,
            sizes.weights as f64 / GIB,
            sizes.kv_bytes(sizes.kv_blocks) as f64 / GIB,
            sizes.kv_blocks,
            sizes.block_tokens
        );
        gpu = Some(info);
    }
    // Load 1.0: the lower bound (or --rate). Where compute binds first, memory binds only past
    // it, and no policy of memory can help below it.
    let (memory, compute) = bound_rates(a, &sizes, &feeds);
    let rate1 = a.rate.unwrap_or(memory.min(compute));
    println!(
        "bench: per model, the KV budget fills at {memory:.3} requests/s and compute at {compute:.3}: {} binds first",
        if memory <= compute { "memory" } else { "compute" }
    );
    let (commit, machine) = (commit(), machine(gpu.as_ref()));
    let traces: Vec<String> = (0..a.models)
        .map(|m| a.sources[m % a.sources.len()].name().to_string())
        .collect();
    let runs_dir = a.out.join("runs");
    std::fs::create_dir_all(&runs_dir).map_err(|e| format!("{}: {e}", runs_dir.display()))?;
    println!(
        "bench: {} models ({}), load 1.0 = {rate1:.3} requests/s per model, SLO TTFT <= {} s, TPOT <= {} s",
        a.models,
        traces.join(","),
        a.slo.ttft_s,
        a.slo.tpot_s
    );
    let mut all = Vec::new();
    // Per run: each model's trace and its stats, for the table per model.
    let mut per: Vec<PerModel> = Vec::new();
    let total = a.seeds.len() * a.loads.len() * a.policies.len();
    // One deployment serves every run of the sweep: engines are loaded once.
    let sleeps = a.policies.iter().any(|p| p.sleeps());
    let mut deployment =
        deploy::Deployment::start(launcher, &sizes, a.models, a.reclaim_wait_ms, sleeps)?;
    for (si, &seed) in a.seeds.iter().enumerate() {
        for &load in &a.loads {
            let rate = load * rate1;
            let reqs = requests(a, &feeds, seed, rate)?;
            let demand: Vec<f64> = reqs
                .iter()
                .map(|r| r.len() as f64 * workload::demand_per_request(r))
                .collect();
            // The policies' order rotates from seed to seed.
            let n = a.policies.len();
            for j in 0..n {
                let policy = a.policies[(j + si) % n];
                let point = Point {
                    policy,
                    sizes: sizes.clone(),
                    requests: reqs.clone(),
                    demand: demand.clone(),
                    duration_s: a.duration_s,
                    drain_s: a.drain_s,
                    reclaim_wait_ms: a.reclaim_wait_ms,
                    sleep_idle_s: a.sleep_idle_s,
                };
                let result = deployment.run(&point)?;
                // The broker's books after every run: a drift is a defect, not noise.
                if let Some(audit) = deployment.snapshot()?.audit {
                    eprintln!("bench: the broker's books do not balance after this run: {audit}");
                }
                let records = result.records();
                let stats = RunStats::of(&records, &a.slo, a.duration_s, result.end_s);
                let per_model: Vec<RunStats> = (0..a.models)
                    .map(|m| {
                        let r: Vec<_> = records.iter().filter(|r| r.model == m).copied().collect();
                        RunStats::of(&r, &a.slo, a.duration_s, result.end_s)
                    })
                    .collect();
                let failed: u64 = result.engines.iter().map(|e| e.counters.oom).sum();
                let refusals: u64 = result.engines.iter().map(|e| e.kv_refusals).sum();
                let setup = result.engines.iter().map(|e| e.setup_s).fold(0.0, f64::max);
                // A failed step is no SLO miss to average away: it is shown, with the errors.
                for e in result.engines.iter().filter(|e| !e.errors.is_empty()) {
                    eprintln!(
                        "bench: model {} had {} failed steps: {}",
                        e.model,
                        e.counters.oom,
                        e.errors.join("; ")
                    );
                }
                println!(
                    "[{}/{total}] load {load} seed {seed} {:<12}: {} requests, {} finished, {} censored, {} refused; SLO {:.3}, goodput {:.2}/s, ttft p50/p99 {:.3}/{:.3} s, tpot p50 {:.4} s; failed steps {failed}, KV refusals {refusals}; setup {setup:.1} s ({:.1} s)",
                    all.len() + 1,
                    policy.name(),
                    stats.requests,
                    stats.finished,
                    stats.censored,
                    stats.refused,
                    stats.slo_attainment,
                    stats.goodput,
                    stats.ttft_p50,
                    stats.ttft_p99,
                    stats.tpot_p50,
                    result.wall_s
                );
                if policy.sleeps() {
                    let sum = |f: fn(&deploy::EngineReport) -> f64| -> f64 {
                        result.engines.iter().map(f).sum()
                    };
                    let wakes = sum(|e| e.wakes as f64);
                    let waited = sum(|e| e.wakes_waited as f64);
                    println!(
                        "    sleeps {}, wakes {wakes} (mean {:.3} s each), {waited} of them waited for room (mean {:.3} s)",
                        sum(|e| e.sleeps as f64),
                        sum(|e| e.wake_s) / wakes.max(1.0),
                        sum(|e| e.wake_wait_s) / waited.max(1.0)
                    );
                }
                let file = RunFile {
                    command: command.to_string(),
                    commit: commit.clone(),
                    machine: machine.clone(),
                    policy: policy.name().to_string(),
                    load,
                    rate,
                    seed,
                    traces: traces.clone(),
                    slo: a.slo,
                    duration_s: a.duration_s,
                    drain_s: a.drain_s,
                    reclaim_wait_ms: a.reclaim_wait_ms,
                    stats: stats.clone(),
                    per_model: per_model.clone(),
                    sizes: sizes.clone(),
                    device: gpu.clone(),
                    result,
                };
                let path = runs_dir.join(format!("{load}-{}-s{seed}.json", policy.name()));
                let json = serde_json::to_vec_pretty(&file).map_err(|e| e.to_string())?;
                std::fs::write(&path, json).map_err(|e| format!("{}: {e}", path.display()))?;
                all.push((load, policy.name().to_string(), stats));
                per.push((
                    load,
                    policy.name().to_string(),
                    traces.iter().cloned().zip(per_model).collect(),
                ));
            }
        }
    }
    deployment.stop()?;
    write_summary(
        &all,
        &per,
        &a.out,
        Summary {
            command: command.to_string(),
            commit,
            machine,
            slo: a.slo,
            nominal_rate: rate1,
            cells: Vec::new(),
            knee: None,
        },
    )
}

/// Summarise `all` (load, policy, stats) into `head`'s cells and knee, print the table and
/// write it, the plot and `summary.json` into `out`.
fn write_summary(
    all: &[(f64, String, RunStats)],
    per: &[PerModel],
    out: &Path,
    mut head: Summary,
) -> Result<Summary, String> {
    let (cells, knee) = summarise(all);
    let mut text = table(&cells, &head.slo);
    text.push_str(&per_model_table(per));
    let any_static = cells.iter().any(|c| c.policy.starts_with("static"));
    let _ = writeln!(
        text,
        "\nknee (best static SLO attainment below 99%): {}",
        match knee {
            Some(k) => format!("load {k:.3}"),
            None if any_static => "not reached".into(),
            None => "no static policy in the sweep".into(),
        }
    );
    print!("{text}");
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let write = |name: &str, bytes: &[u8]| {
        let p = out.join(name);
        std::fs::write(&p, bytes).map_err(|e| format!("{}: {e}", p.display()))
    };
    write("table.txt", text.as_bytes())?;
    write(
        "slo-attainment.svg",
        attainment_svg(&cells, &head.slo).as_bytes(),
    )?;
    head.cells = cells;
    head.knee = knee;
    write(
        "summary.json",
        &serde_json::to_vec_pretty(&head).map_err(|e| e.to_string())?,
    )?;
    Ok(head)
}

/// What [`from_saved`] reads of a saved run.
#[derive(Deserialize)]
struct SavedRun {
    command: String,
    commit: String,
    machine: String,
    policy: String,
    load: f64,
    rate: f64,
    slo: Slo,
    stats: RunStats,
    /// Each model's trace (older runs: none).
    #[serde(default)]
    traces: Vec<String>,
    /// Each model's stats (older runs: none).
    #[serde(default)]
    per_model: Vec<RunStats>,
}

/// Summarise saved runs, as a sweep does at its end: every `runs/*.json` under `dirs` (the
/// `--out` of earlier commands, a sweep spread over several), into `out`. Runs of different
/// SLOs or nominal rates are refused: they do not belong in one table.
pub fn from_saved(dirs: &[PathBuf], out: &Path) -> Result<Summary, String> {
    let mut all = Vec::new();
    let mut per = Vec::new();
    let mut head: Option<Summary> = None;
    for d in dirs {
        let runs = d.join("runs");
        let mut paths: Vec<PathBuf> = std::fs::read_dir(&runs)
            .map_err(|e| format!("{}: {e}", runs.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        paths.sort();
        for p in paths {
            let bytes = std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            let r: SavedRun =
                serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", p.display()))?;
            let nominal = if r.load > 0.0 { r.rate / r.load } else { 0.0 };
            match &mut head {
                None => {
                    head = Some(Summary {
                        command: r.command.clone(),
                        commit: r.commit.clone(),
                        machine: r.machine.clone(),
                        slo: r.slo,
                        nominal_rate: nominal,
                        cells: Vec::new(),
                        knee: None,
                    })
                }
                Some(h) => {
                    // Commands of one sweep measure the device's free memory each: their KV
                    // budgets, so their load 1.0, may differ by a few blocks.
                    let apart = (h.nominal_rate - nominal).abs()
                        > 5e-3 * h.nominal_rate.abs().max(nominal.abs());
                    if h.slo != r.slo || apart {
                        return Err(format!(
                            "{}: SLO {:?} at {nominal:.4}/s nominal, where the first run had {:?} at {:.4}/s (load 1.0 may differ by 0.5% at most)",
                            p.display(),
                            r.slo,
                            h.slo,
                            h.nominal_rate
                        ));
                    }
                    for (mine, theirs) in [(&mut h.command, &r.command), (&mut h.commit, &r.commit)]
                    {
                        if !mine.split(" | ").any(|c| c == theirs) {
                            mine.push_str(" | ");
                            mine.push_str(theirs);
                        }
                    }
                }
            }
            per.push((
                r.load,
                r.policy.clone(),
                r.traces.into_iter().zip(r.per_model).collect(),
            ));
            all.push((r.load, r.policy, r.stats));
        }
    }
    let head = head.ok_or_else(|| format!("no saved runs under {dirs:?}"))?;
    println!("{} saved runs", all.len());
    write_summary(&all, &per, out, head)
}
