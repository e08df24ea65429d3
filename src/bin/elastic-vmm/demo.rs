//! `demo`: the main job in one command. Several models share one memory budget, each serving
//! sequences from its own paged KV cache ([`PagedKv`]); their loads rise and fall out of phase.
//! The same seeded workload runs twice on the same budget: once split statically (each model a
//! fixed 1/K, as engines reserve today) and once elastic (one budget: a model's KV grows into
//! what the others do not hold, and pages go back when its blocks are freed). It prints a table
//! as it goes, a comparison at the end and draws the elastic run's memory per model.
//!
//! Time is in scheduler steps, not seconds: this shows the mechanism; the serving benchmark
//! (`examples/serve`) measures wall-clock latency.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use elastic_vmm::kv::{BlockId, PagedKv, PagedKvConfig};
use elastic_vmm::stats::human_bytes;
use elastic_vmm::{Backend, Error, ModelConfig, PoolConfig, SharedPool, SharedPoolConfig};

use crate::output;
use crate::plot::{self, Series};
use crate::{at_least, mul, to_usize, ArgError, BoxError};

#[derive(clap::Args, Clone)]
pub struct DemoArgs {
    /// Models sharing the budget (2 to 6).
    #[arg(long, default_value_t = 3)]
    pub models: usize,
    /// Scheduler steps per policy.
    #[arg(long, default_value_t = 600)]
    pub steps: usize,
    /// Steps per load cycle: each model's load peaks once per cycle, the models out of phase.
    #[arg(long, default_value_t = 300)]
    pub period: usize,
    /// The budget all models share, in MiB (KV memory only).
    #[arg(long, default_value_t = 768)]
    pub budget_mib: u64,
    /// Requests per step arriving at a model at the peak of its load.
    #[arg(long, default_value_t = 1.0)]
    pub peak_rate: f64,
    /// Longest prompt in tokens (prompts are uniform from 64 up to it).
    #[arg(long, default_value_t = 1024)]
    pub max_prompt: usize,
    /// Longest output in tokens (outputs are uniform from 32 up to it).
    #[arg(long, default_value_t = 512)]
    pub max_output: usize,
    /// Tokens each running sequence decodes per step.
    #[arg(long, default_value_t = 8)]
    pub tokens_per_step: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_tokens: usize,
    /// Print a line every this many steps.
    #[arg(long, default_value_t = 50)]
    pub report_every: usize,
    /// Seed of the workload generator (both policies see the same requests).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Where to write the SVG plot of the elastic run (missing folders are created).
    #[arg(long, default_value = "demo.svg")]
    pub svg: PathBuf,
}

/// The KV shape every model uses: 4 layers, 8 KV heads of 128 f16 values (a block of 16
/// tokens is 32 KiB per K or V tensor, 256 KiB in all).
const LAYERS: usize = 4;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const ELEM_BYTES: usize = 2;
const NAMES: [&str; 6] = ["chat", "code", "docs", "search", "agent", "vision"];
const COLORS: [&str; 6] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
];

/// A tiny deterministic generator for the workload.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One request of the workload.
#[derive(Clone, Copy)]
struct Request {
    arrival: usize,
    prompt: usize,
    output: usize,
}

/// Load in [0, 1] at `step`: a quiet base and one burst per period, shifted by `phase`.
fn load(step: usize, period: usize, phase: f64) -> f64 {
    let x = step as f64 / period as f64 - phase;
    let burst = (std::f64::consts::PI * x).sin().powi(2).powi(2);
    (0.05 + 0.95 * burst).clamp(0.0, 1.0)
}

/// Every model's requests, by arrival step: the same for both policies.
fn workload(a: &DemoArgs) -> Vec<Vec<Request>> {
    let mut rng = Rng(a.seed.max(1));
    (0..a.models)
        .map(|m| {
            let phase = m as f64 / a.models as f64;
            let mut out = Vec::new();
            for step in 0..a.steps {
                // Bernoulli thinning of `peak_rate` per step (several draws when above 1).
                let rate = a.peak_rate * load(step, a.period, phase);
                let whole = rate.floor() as usize;
                let n = whole + usize::from(rng.unit() < rate - whole as f64);
                for _ in 0..n {
                    out.push(Request {
                        arrival: step,
                        prompt: rng.range(64, a.max_prompt),
                        output: rng.range(32, a.max_output),
                    });
                }
            }
            out
        })
        .collect()
}

#[derive(Clone, Copy, PartialEq)]
enum Policy {
    Static,
    Elastic,
}

impl Policy {
    fn name(self) -> &'static str {
        match self {
            Policy::Static => "static 1/K",
            Policy::Elastic => "elastic",
        }
    }
}

struct Running {
    request: Request,
    tokens: usize,
    target: usize,
    blocks: Vec<BlockId>,
}

struct Model {
    kv: PagedKv,
    queue: VecDeque<Request>,
    running: Vec<Running>,
    next: usize,
    waits: Vec<usize>,
    stalls: u64,
    preemptions: u64,
    finished: usize,
    tokens: u64,
    series: Series,
}

/// What one policy's run gave.
struct Outcome {
    policy: Policy,
    requests: usize,
    finished: usize,
    unserved: usize,
    waits: Vec<usize>,
    stalls: u64,
    preemptions: u64,
    tokens: u64,
    peak_used: u64,
    end_used: u64,
    series: Vec<Series>,
}

pub fn run(backend: Arc<dyn Backend>, a: &DemoArgs) -> Result<(), BoxError> {
    at_least("--models", a.models as u64, 2)?;
    if a.models > NAMES.len() {
        return Err(ArgError::Invalid(format!(
            "--models {} is more than the demo's {} models",
            a.models,
            NAMES.len()
        ))
        .into());
    }
    for (what, v) in [
        ("--steps", a.steps),
        ("--period", a.period),
        ("--block-tokens", a.block_tokens),
        ("--tokens-per-step", a.tokens_per_step),
        ("--report-every", a.report_every),
        ("--budget-mib", to_usize("--budget-mib", a.budget_mib)?),
    ] {
        at_least(what, v as u64, 1)?;
    }
    if a.block_tokens > 4096 {
        return Err(ArgError::Invalid(format!(
            "--block-tokens must be at most 4096, got {}",
            a.block_tokens
        ))
        .into());
    }
    at_least("--max-prompt", a.max_prompt as u64, 64)?;
    at_least("--max-output", a.max_output as u64, 32)?;
    if !(a.peak_rate.is_finite() && a.peak_rate > 0.0 && a.peak_rate <= 64.0) {
        return Err(ArgError::Invalid(format!(
            "--peak-rate must be above 0 and at most 64 requests per step, got {}",
            a.peak_rate
        ))
        .into());
    }
    let budget = mul("--budget-mib in bytes", a.budget_mib, 1 << 20)?;
    let shape = |max_blocks| {
        PagedKvConfig::new(
            LAYERS,
            KV_HEADS,
            HEAD_DIM,
            a.block_tokens,
            ELEM_BYTES,
            max_blocks,
        )
    };
    let per_tensor = shape(1).block_bytes_per_tensor()?;
    let block_bytes = mul("a block in all tensors", per_tensor, 2 * LAYERS as u64)?;
    // Each cache can address the whole budget (and a page group more): virtual space is free.
    let max_blocks = to_usize("blocks per cache", budget / block_bytes + 256)?;
    let requests = workload(a);
    let total: usize = requests.iter().map(Vec::len).sum();
    let info = backend.info();
    println!(
        "demo on {} ({}): {} models share {} of KV memory; {} requests over {} steps, each model's load peaking in turn",
        info.name,
        info.device_name,
        a.models,
        human_bytes(budget),
        total,
        a.steps
    );
    println!(
        "each model: a paged KV cache of {LAYERS} layers x {KV_HEADS} heads x {HEAD_DIM} dims, {}-token blocks of {}; {} of addresses reserved, none mapped",
        a.block_tokens,
        human_bytes(block_bytes),
        human_bytes(mul("cache bytes", max_blocks as u64, block_bytes)?)
    );
    let mut outcomes = Vec::new();
    for policy in [Policy::Static, Policy::Elastic] {
        outcomes.push(serve(&backend, a, policy, budget, &requests, max_blocks)?);
    }
    summary(a, budget, &outcomes);
    let elastic = outcomes
        .pop()
        .ok_or("the elastic run is missing from the outcomes")?;
    let peak_sum = elastic
        .series
        .iter()
        .map(|s| s.physical.iter().copied().max().unwrap_or(0))
        .fold(0u64, u64::saturating_add);
    let svg = plot::render(
        &format!(
            "{} models' KV caches sharing {} ({}), elastic",
            a.models,
            human_bytes(budget),
            info.name
        ),
        &elastic.series,
        budget,
        peak_sum,
    );
    output::write_file(&a.svg, svg.as_bytes())?;
    println!("  plot of the elastic run written to {}", a.svg.display());
    Ok(())
}

/// Runs the workload under `policy` on a fresh shared pool of `budget`.
fn serve(
    backend: &Arc<dyn Backend>,
    a: &DemoArgs,
    policy: Policy,
    budget: u64,
    requests: &[Vec<Request>],
    max_blocks: usize,
) -> Result<Outcome, BoxError> {
    let shared = SharedPool::new(
        backend.clone(),
        SharedPoolConfig::new().global_limit(budget),
    )?;
    let share = budget / a.models as u64;
    let mut models = Vec::new();
    for (i, name) in NAMES.iter().take(a.models).enumerate() {
        let config = shape_config(a, max_blocks);
        let capacity = to_usize(
            "cache addresses",
            mul(
                "cache addresses",
                max_blocks as u64,
                config.block_bytes_per_tensor()?,
            )?,
        )?;
        // Virtual space for the cache's tensors, each on its own pages, with room to spare.
        let virtual_capacity = capacity
            .checked_mul(2 * LAYERS + 2)
            .ok_or("the cache's address space overflows")?;
        // Pages the cache frees go back to the budget at once (no chunk cache kept per
        // model), so each model's held memory follows its live blocks.
        let pool = PoolConfig::new(virtual_capacity).max_cached(0);
        let model = shared.register(
            match policy {
                Policy::Static => ModelConfig::new(*name, virtual_capacity, share).guarantee(share),
                Policy::Elastic => ModelConfig::new(*name, virtual_capacity, budget),
            }
            .pool_config(pool),
        )?;
        let kv = PagedKv::new(&model, config)?;
        models.push(Model {
            kv,
            queue: VecDeque::new(),
            running: Vec::new(),
            next: 0,
            waits: Vec::new(),
            stalls: 0,
            preemptions: 0,
            finished: 0,
            tokens: 0,
            series: Series {
                name: (*name).to_string(),
                color: COLORS[i],
                physical: Vec::new(),
                in_use: Vec::new(),
                asleep: Vec::new(),
            },
        });
    }
    println!();
    println!(
        "{}: {}",
        policy.name(),
        match policy {
            Policy::Static => format!(
                "each model limited to and guaranteed {}",
                human_bytes(share)
            ),
            Policy::Elastic => format!(
                "one budget of {}: a model's KV grows into what the others do not hold",
                human_bytes(budget)
            ),
        }
    );
    let header: Vec<String> = NAMES
        .iter()
        .take(a.models)
        .map(|n| format!("{:>22}", format!("{n} run/wait held")))
        .collect();
    println!("{:>5} {} {:>10}", "step", header.join(" "), "budget");
    let block_bytes = models[0].kv.block_span_bytes() * models[0].kv.tensors() as u64;
    let mut peak_used = 0u64;
    let started = Instant::now();
    for step in 0..a.steps {
        for (m, reqs) in models.iter_mut().zip(requests) {
            step_model(m, reqs, step, a)?;
        }
        let st = shared.stats();
        peak_used = peak_used.max(st.global.used);
        for (m, ms) in models.iter_mut().zip(&st.models) {
            m.series.physical.push(ms.used);
            let live = m.kv.stats().live as u64;
            m.series.in_use.push(live.saturating_mul(block_bytes));
            m.series.asleep.push(false);
        }
        if step % a.report_every == 0 || step + 1 == a.steps {
            let cells: Vec<String> = models
                .iter()
                .zip(&st.models)
                .map(|(m, ms)| {
                    format!(
                        "{:>22}",
                        format!(
                            "{:>3}/{:<3} {}",
                            m.running.len(),
                            m.queue.len(),
                            human_bytes(ms.used)
                        )
                    )
                })
                .collect();
            println!(
                "{:>5} {} {:>9.0}%",
                step,
                cells.join(" "),
                100.0 * st.global.used as f64 / st.global.limit as f64
            );
        }
        if let Err(e) = shared.audit() {
            return Err(format!("{}: accounting broke at step {step}: {e}", policy.name()).into());
        }
    }
    let end_used = shared.stats().global.used;
    let mut out = Outcome {
        policy,
        requests: requests.iter().map(Vec::len).sum(),
        finished: 0,
        unserved: 0,
        waits: Vec::new(),
        stalls: 0,
        preemptions: 0,
        tokens: 0,
        peak_used,
        end_used,
        series: Vec::new(),
    };
    for mut m in models {
        out.finished += m.finished;
        // Requests still queued or running at the end are counted, not dropped.
        out.unserved += m.queue.len() + m.running.len();
        for r in &m.queue {
            m.waits.push(a.steps - r.arrival);
        }
        out.waits.append(&mut m.waits);
        out.stalls += m.stalls;
        out.preemptions += m.preemptions;
        out.tokens += m.tokens;
        for r in std::mem::take(&mut m.running) {
            m.kv.free(&r.blocks)?;
        }
        out.series.push(m.series);
    }
    // Every sequence freed: the caches give every page back to the budget.
    let left = shared.stats().global;
    if left.in_use != 0 || left.used != 0 {
        return Err(format!(
            "{}: {} in use and {} held after every sequence was freed",
            policy.name(),
            human_bytes(left.in_use),
            human_bytes(left.used)
        )
        .into());
    }
    println!(
        "{}: {} steps in {:.2?}; {} held by the models at the end",
        policy.name(),
        a.steps,
        started.elapsed(),
        human_bytes(end_used)
    );
    Ok(out)
}

fn shape_config(a: &DemoArgs, max_blocks: usize) -> PagedKvConfig {
    PagedKvConfig::new(
        LAYERS,
        KV_HEADS,
        HEAD_DIM,
        a.block_tokens,
        ELEM_BYTES,
        max_blocks,
    )
}

/// One step of one model's engine: arrivals queue, queued requests are admitted in order while
/// their prompt's blocks can be had, running ones decode and take a block when one fills,
/// finished ones free theirs.
fn step_model(m: &mut Model, reqs: &[Request], step: usize, a: &DemoArgs) -> Result<(), BoxError> {
    while m.next < reqs.len() && reqs[m.next].arrival <= step {
        m.queue.push_back(reqs[m.next]);
        m.next += 1;
    }
    // Decode first: running sequences have priority over new ones. A sequence that cannot
    // get its next block preempts the latest admitted one (its blocks freed, back to the head
    // of the queue to be prefilled again), as vLLM's scheduler does; alone, it waits.
    let mut i = 0;
    while i < m.running.len() {
        let r = &m.running[i];
        let want = (r.tokens + a.tokens_per_step)
            .min(r.target)
            .div_ceil(a.block_tokens);
        let more = want.saturating_sub(r.blocks.len());
        if more > 0 {
            match m.kv.alloc(more) {
                Ok(ids) => m.running[i].blocks.extend(ids),
                Err(e) if out_of_memory(&e) => {
                    if m.running.len() - 1 > i {
                        let victim = m.running.pop().ok_or("no sequence to preempt")?;
                        m.kv.free(&victim.blocks)?;
                        m.queue.push_front(victim.request);
                        m.preemptions += 1;
                    } else {
                        m.stalls += 1;
                        i += 1;
                    }
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let r = &mut m.running[i];
        let n = a.tokens_per_step.min(r.target - r.tokens);
        r.tokens += n;
        m.tokens += n as u64;
        i += 1;
    }
    let mut i = 0;
    while i < m.running.len() {
        if m.running[i].tokens >= m.running[i].target {
            let r = m.running.swap_remove(i);
            m.kv.free(&r.blocks)?;
            m.finished += 1;
        } else {
            i += 1;
        }
    }
    while let Some(r) = m.queue.front().copied() {
        match m.kv.alloc(r.prompt.div_ceil(a.block_tokens)) {
            Ok(blocks) => {
                m.queue.pop_front();
                m.waits.push(step - r.arrival);
                m.running.push(Running {
                    request: r,
                    tokens: r.prompt,
                    target: r.prompt + r.output,
                    blocks,
                });
            }
            Err(e) if out_of_memory(&e) => break,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn out_of_memory(e: &Error) -> bool {
    matches!(
        e,
        Error::AdmissionRefused { .. } | Error::KvOutOfBlocks { .. }
    )
}

/// The `q` quantile (nearest rank) of `v`, sorted in place.
fn quantile(v: &mut [usize], q: f64) -> usize {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn summary(a: &DemoArgs, budget: u64, outcomes: &[Outcome]) {
    println!();
    println!(
        "summary: the same {} requests on the same {} budget (waits in steps from arrival to admission; a request still queued at the end counts its wait so far)",
        outcomes.first().map_or(0, |o| o.requests),
        human_bytes(budget)
    );
    println!(
        "  {:<11} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10}",
        "policy",
        "finished",
        "unserved",
        "wait p50",
        "wait p99",
        "preempted",
        "stalled",
        "tokens",
        "peak held",
        "end held"
    );
    for o in outcomes {
        let mut w = o.waits.clone();
        let p50 = quantile(&mut w, 0.5);
        let p99 = quantile(&mut w, 0.99);
        println!(
            "  {:<11} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10}",
            o.policy.name(),
            o.finished,
            o.unserved,
            p50,
            p99,
            o.preemptions,
            o.stalls,
            o.tokens,
            human_bytes(o.peak_used),
            human_bytes(o.end_used)
        );
    }
    if let [s, e] = outcomes {
        for (name, (ss, es)) in e
            .series
            .iter()
            .map(|x| &x.name)
            .zip(s.series.iter().zip(&e.series))
        {
            let peak = |x: &Series| x.physical.iter().copied().max().unwrap_or(0);
            let mean = |x: &Series| {
                x.physical.iter().map(|&b| b as f64).sum::<f64>() / x.physical.len().max(1) as f64
            };
            println!(
                "  {name:<7} held: static peak {:>10} (its share {}), elastic peak {:>10} mean {:>10} at the end {:>10}",
                human_bytes(peak(ss)),
                human_bytes(budget / a.models as u64),
                human_bytes(peak(es)),
                human_bytes(mean(es) as u64),
                human_bytes(es.physical.last().copied().unwrap_or(0))
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use elastic_vmm::backend::{self, host::HostBackend};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        demo: DemoArgs,
    }

    #[test]
    fn elastic_memory_follows_each_models_load_and_goes_back() {
        let backend: Arc<dyn Backend> =
            Arc::new(HostBackend::new(backend::host::DEFAULT_GRANULARITY).expect("host backend"));
        let a = Cli::parse_from(["demo", "--steps", "300", "--period", "150"]).demo;
        let budget = a.budget_mib << 20;
        let share = budget / a.models as u64;
        let requests = workload(&a);
        let max_blocks = (budget / (256 << 10)) as usize + 256;
        let run = |policy| {
            serve(&backend, &a, policy, budget, &requests, max_blocks).expect("the demo runs")
        };
        let (fixed, elastic) = (run(Policy::Static), run(Policy::Elastic));
        for (s, e) in fixed.series.iter().zip(&elastic.series) {
            let peak = |x: &Series| x.physical.iter().copied().max().unwrap_or(0);
            assert!(
                peak(s) <= share,
                "{}: static held {} over its share",
                s.name,
                peak(s)
            );
            // Elastic: the model's burst takes more than a static share, and once its load
            // drops its memory goes back to the budget.
            let at = e.physical.iter().position(|&b| b == peak(e)).unwrap();
            let after = e.physical[at..].iter().copied().min().unwrap();
            assert!(
                peak(e) > share,
                "{}: elastic peak {} within its share",
                e.name,
                peak(e)
            );
            assert!(
                after <= peak(e) / 4,
                "{}: held {} after a peak of {}",
                e.name,
                after,
                peak(e)
            );
        }
        // Every request counted in both runs, and the elastic one served at least as many.
        for o in [&fixed, &elastic] {
            assert_eq!(o.finished + o.unserved, o.requests);
        }
        assert!(elastic.finished >= fixed.finished);
    }
}
