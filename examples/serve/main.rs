//! Many models on one GPU, end to end (issues 24 and 32), in two deployments.
//!
//! **`serve bench`: the deployment users run** (`bench.rs`, `deploy.rs`, `metrics.rs`,
//! `workload.rs`). One broker process and one engine process per model (this binary
//! re-executed in each role), on wall clock, open loop: each engine admits a request when the
//! wall clock reaches its arrival, from one start instant (`CLOCK_MONOTONIC`) all engines
//! share, whatever it is doing; TTFT is its first token less its arrival, so allocation,
//! mapping, the broker's reclaim and hand-over between engines and every wait are inside
//! what is measured. Every request of the trace has a record (finished, censored at the
//! run's end, refused); SLO attainment (TTFT <= S1 and mean TPOT <= S2, both printed),
//! goodput and TTFT/TPOT p50/p90/p99 count them all, censored values at their lower bound.
//! Each model replays a window of a real trace (Azure LLM inference 2023 conversation and code:
//! CC-BY 4.0, Patel et al., ISCA 2024; Mooncake conversation: Apache-2.0, Qin et al., FAST
//! 2025; the files are in `../shared/traces` beside the repository, with their README) or the
//! seeded generator's trace, time-scaled to the load point; seeds pick windows. Policies:
//! static equal split, static best split (shares proportional to each model's mean demand),
//! elastic, and with sleep (idle models swapped out to host memory): static + sleep (whole
//! models swapped) and elastic + sleep; the same engine. Per load point it prints a table of each metric's mean and 95%
//! confidence interval over seeds per policy, saves every run as JSON (command, commit,
//! machine, every record), `summary.json` with the knee (the load at which the best static
//! policy's SLO attainment falls below 99%) and `slo-attainment.svg` (confidence bands). It
//! runs on the host backend with simulated compute (a step sleeps for the cost model's time;
//! costs chosen so that memory binds), or with `--gpu small|8b` on CUDA device 0: the broker
//! on CUDA chunks, each engine a candle Llama of that shape with random weights loaded into
//! its broker model's pool, its KV a paged KV cache there (`PagedKvTensors`), attended in
//! place by the paged-attention kernel, every step real kernels (the engines share the GPU's
//! compute, time-sliced, as separate engine processes do). The budget is the device's free
//! memory less `--reserve-gib` per engine (contexts, cuBLAS), the KV budget what the models'
//! bases (weights, `--act-reserve-gib`) leave: no ballast. Flags: see `bench.rs`; for example
//!
//! ```text
//! serve bench --sim --seeds 1,2,3,4,5 --loads 0.5,1,1.5 --duration 20 --drain 5 \
//!     --traces conv,code,mooncake --slo-ttft 1 --slo-tpot 0.05 --out $OUT/bench
//! serve bench --gpu 8b --seeds 1,2,3 --loads 0.5,1,2 --duration 30 --drain 5 --out $OUT/b
//! ```
//!
//! **The in-process driver** (the rest of this page; `cluster.rs`): K Llama-shaped candle
//! models with random weights, every allocation routed into its model of one shared pool
//! (`SharedPool`), each behind a continuous-batching engine whose KV is a paged KV cache
//! (`elastic_vmm::kv::PagedKv`; on the GPU its candle tensors, attended through block tables:
//! `paged_llama.rs`), serve one seeded bursty trace under three memory policies (static 1/K
//! partitions, elastic, elastic with sleep), swept over load. Its clock is virtual (advanced
//! by forward time; models stepped round-robin in one process) and its percentiles count
//! finished requests only: it checks the policies' mechanics, and `serve bench` measures.
//!
//! ```text
//! serve [--sizes small,8b] [--duration S] [--drain S] [--points 0,1,2,3,4] [--loads-small R,..]
//!       [--loads-8b R,..] [--policies static,elastic,sleep] [--models K] [--idle S]
//!       [--kv-share-gib-small G] [--kv-share-gib-8b G] [--max-batch N] [--seed N] [--out DIR]
//!       [--resident N] [--budget-gib G] [--prefill-chunk N] [--max-context N] [--host-gib G]
//! serve --sweep-models 3,4,6,8 [--slo S] [--burst-rate R] [--on S] [--off S] ...
//!                        the sleep goal: the most models each policy serves at a p99-TTFT SLO
//! serve --trace FILE ... the policies on one saved trace (a `traces/*.json` of an earlier run)
//! serve --sim ...        the same on the host backend with simulated compute (no GPU)
//! ```
//!
//! Per size: a calibration probe (10 s at a rate no model keeps up with, elastic) measures the
//! device's capacity in output tokens per second; the load points are fractions
//! 0.25, 0.5, 0.75, 1.0, 1.5 of the peak rate per model at which the trace's mean demand equals
//! that capacity (`--loads-*` gives them instead and skips the probe). The 8B-shaped models run
//! only points 2 and 4 (the knee and saturation) unless `--points-8b` says otherwise. Each run
//! prints its summary lines as it finishes and saves them as JSON under `--out` (default
//! `$OUT/serve`, else `target/serve`), with the traces; SVGs of p99 TTFT against load per size
//! and of memory per model over time (point 2, each policy) follow each size.
//!
//! Models are loaded one after the other, each warmed at once by the largest steps the engine
//! runs (a prefill chunk of `--prefill-chunk` tokens at `--max-context`, a decode of
//! `--max-batch` sequences at `--max-context`; longer requests are refused) and trimmed; its
//! base is its weights and that peak of activations, with a margin. Every run starts from the
//! same state: no KV, every awake model's idle and cached memory given back. Sleeps go through
//! one host tier shared by all models (`Pool::host_tier`, at most `--host-gib`), not staging
//! pinned per model. The table: TTFT p50/p99, TPOT p50 and token-weighted mean, tokens/s, mean
//! decode batch, preemptions, refusals, OOM, peak and mean physical GiB, `held` GiB (use or
//! guarantee, whichever is more: what the policy keeps from the others), driver calls and
//! budget calls per step.
//!
//! Needs a CUDA GPU and the `candle-example` feature, except with `--sim`.
//!
//! On a GPU machine without Rust (`scripts/gpu-bundle.sh candle-example` puts `serve` in the
//! bundle), in commands of under 9.5 minutes each (estimates from the H100 logs in
//! `docs/results/serve`: a run takes about its trace and drain, less at low load):
//!
//! ```text
//! # small models, 60 s traces, five points x three policies, in three commands:
//! ./serve --sizes small --points 0,1 --out $OUT/small        # ~7 min: probe, 6 runs; prints
//!                                                             # --loads-small a,b,c,d,e
//! ./serve --sizes small --points 2,3 --loads-small a,b,c,d,e --out $OUT/small   # ~7.5 min
//! ./serve --sizes small --points 4 --loads-small a,b,c,d,e --out $OUT/small     # ~4 min
//! # 8B-shaped, the knee and saturation (3 x 15 GiB of weights, 5 GiB of KV each under static):
//! ./serve --sizes 8b --duration 50 --drain 10 --out $OUT/8b  # ~7 min: probe, 6 runs
//! # the sleep goal, 8B-shaped: up to 8 models on a 74 GiB budget (static partitions it, sleep
//! # offloads idle models to the host tier); bursts of 8 s at 0.5/s then 24 s idle per model:
//! ./serve --sizes 8b --sweep-models 3,4,6,8 --resident 4 --budget-gib 74 \
//!     --policies static,sleep --duration 48 --drain 10 --burst-rate 0.5 --slo 2 \
//!     --max-batch 32 --out $OUT/models                        # ~8 min
//! ```
//!
//! The sweep (`--sweep-models`) loads the largest count, keeps `--resident` awake and the
//! others asleep in the host tier, then for each policy serves the first n models for each n
//! (ascending; the others asleep) with Prism-style traffic (each model bursts for `--on`
//! seconds at `--burst-rate`, then idles `--off` seconds, the bursts spread over the cycle); a
//! policy that misses the SLO (every request finished, no OOM, p99 TTFT within `--slo`) is not
//! run at larger counts. It prints and saves (`<size>-models.txt`) the most models each policy
//! served at the SLO and the ratio sleep/static (the goal: 2x).
//!
//! Time is virtual (see `cluster.rs`): a run at low load replays faster than its trace, one at
//! saturation takes about the trace and its drain (60 + 15 s). `--duration` shortens them.

mod bench;
mod cluster;
mod deploy;
mod engine;
mod host;
#[cfg(feature = "candle-example")]
mod llama;
mod metrics;
#[cfg(feature = "candle-example")]
mod paged_llama;
#[cfg(feature = "candle-example")]
mod probe;
mod report;
#[cfg(feature = "candle-example")]
mod restart;
mod sleeper;
mod trace;
mod workload;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use cluster::{BlockStore, Policy, RunOptions, RunSummary, Served};
use engine::StepModel;
use trace::{Trace, TraceConfig};

#[cfg(feature = "candle-example")]
elastic_vmm::route_cuda_allocations!();

/// Fractions of the calibrated saturation load.
const FRACTIONS: [f64; 5] = [0.25, 0.5, 0.75, 1.0, 1.5];

struct Args {
    sim: bool,
    sizes: Vec<String>,
    duration: f64,
    drain: f64,
    seed: u64,
    out: PathBuf,
    points: Vec<usize>,
    points_8b: Vec<usize>,
    loads_small: Option<Vec<f64>>,
    loads_8b: Option<Vec<f64>>,
    policies: Vec<Policy>,
    models: usize,
    resident: Option<usize>,
    kv_share_small: f64,
    kv_share_8b: f64,
    max_batch: usize,
    probe_s: f64,
    trace: Option<PathBuf>,
    prefill_chunk: usize,
    max_context: u32,
    budget_gib: Option<f64>,
    host_gib: f64,
    sweep_models: Option<Vec<usize>>,
    slo_s: f64,
    burst_rate: f64,
    on_s: f64,
    off_s: f64,
}

fn list<T: std::str::FromStr>(s: &str) -> Result<Vec<T>, String> {
    s.split(',')
        .map(|x| {
            x.trim()
                .parse()
                .map_err(|_| format!("bad list item {x:?} in {s:?}"))
        })
        .collect()
}

fn parse() -> Result<Args, String> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let out_default = std::env::var_os("OUT")
        .map(|o| PathBuf::from(o).join("serve"))
        .unwrap_or_else(|| PathBuf::from("target/serve"));
    let mut a = Args {
        sim: false,
        sizes: vec!["small".into(), "8b".into()],
        duration: 60.0,
        drain: 15.0,
        seed: 42,
        out: out_default,
        points: (0..FRACTIONS.len()).collect(),
        points_8b: vec![2, 4],
        loads_small: None,
        loads_8b: None,
        policies: vec![
            Policy::Static,
            Policy::Elastic,
            Policy::Sleep { idle_s: 2.0 },
        ],
        models: 3,
        resident: None,
        kv_share_small: 0.25,
        kv_share_8b: 5.0,
        max_batch: 64,
        probe_s: 10.0,
        trace: None,
        prefill_chunk: 512,
        max_context: 4096,
        budget_gib: None,
        host_gib: 96.0,
        sweep_models: None,
        slo_s: 2.0,
        burst_rate: 1.0,
        on_s: 8.0,
        off_s: 24.0,
    };
    let mut idle = 2.0;
    let mut policies: Option<Vec<String>> = None;
    let mut i = 0;
    while i < argv.len() {
        let flag = argv[i].as_str();
        if flag == "--sim" {
            a.sim = true;
            i += 1;
            continue;
        }
        let v = argv
            .get(i + 1)
            .ok_or_else(|| format!("{flag} needs a value"))?
            .clone();
        let num = |v: &str| {
            v.parse::<f64>()
                .map_err(|_| format!("{flag}: bad number {v:?}"))
        };
        match flag {
            "--sizes" => a.sizes = list(&v)?,
            "--duration" => a.duration = num(&v)?,
            "--drain" => a.drain = num(&v)?,
            "--seed" => a.seed = num(&v)? as u64,
            "--out" => a.out = PathBuf::from(v),
            "--points" => a.points = list(&v)?,
            "--points-8b" => a.points_8b = list(&v)?,
            "--loads-small" => a.loads_small = Some(list(&v)?),
            "--loads-8b" => a.loads_8b = Some(list(&v)?),
            "--policies" => policies = Some(list(&v)?),
            "--idle" => idle = num(&v)?,
            "--models" => a.models = num(&v)? as usize,
            "--resident" => a.resident = Some(num(&v)? as usize),
            "--kv-share-gib-small" => a.kv_share_small = num(&v)?,
            "--kv-share-gib-8b" => a.kv_share_8b = num(&v)?,
            "--max-batch" => a.max_batch = num(&v)? as usize,
            "--probe" => a.probe_s = num(&v)?,
            "--trace" => a.trace = Some(PathBuf::from(v)),
            "--prefill-chunk" => a.prefill_chunk = num(&v)? as usize,
            "--max-context" => a.max_context = num(&v)? as u32,
            "--budget-gib" => a.budget_gib = Some(num(&v)?),
            "--host-gib" => a.host_gib = num(&v)?,
            "--sweep-models" => a.sweep_models = Some(list(&v)?),
            "--slo" => a.slo_s = num(&v)?,
            "--burst-rate" => a.burst_rate = num(&v)?,
            "--on" => a.on_s = num(&v)?,
            "--off" => a.off_s = num(&v)?,
            _ => return Err(format!("unknown flag {flag} (see the example's docs)")),
        }
        i += 2;
    }
    if let Some(p) = policies {
        a.policies = p
            .iter()
            .map(|n| match n.as_str() {
                "static" => Ok(Policy::Static),
                "elastic" => Ok(Policy::Elastic),
                "sleep" => Ok(Policy::Sleep { idle_s: idle }),
                _ => Err(format!("unknown policy {n:?}: static, elastic or sleep")),
            })
            .collect::<Result<_, _>>()?;
    } else {
        a.policies[2] = Policy::Sleep { idle_s: idle };
    }
    if a.models == 0 || a.duration <= 0.0 || a.prefill_chunk == 0 || a.max_context == 0 {
        return Err(
            "--models, --duration, --prefill-chunk and --max-context must be positive".into(),
        );
    }
    if let Some(counts) = &a.sweep_models {
        // The sweep loads as many models as its largest point serves.
        a.models = a.models.max(counts.iter().copied().max().unwrap_or(1));
    }
    Ok(a)
}

fn progress(start: Instant, msg: &str) {
    println!("[{:>7.1} s] {msg}", start.elapsed().as_secs_f64());
}

/// Everything a sweep over one model size needs.
struct SizeRun<'a, S: BlockStore, M: StepModel> {
    name: &'a str,
    gpu: &'a elastic_vmm::SharedPool,
    models: &'a mut [Served<S, M>],
    budget: u64,
    sync: &'a dyn Fn() -> Result<(), String>,
}

fn trace_config(a: &Args, peak: f64) -> TraceConfig {
    TraceConfig::kvcached_like(a.seed, a.models, peak, a.duration)
}

/// The peak rate per model at which the trace's mean demand is the measured capacity.
fn probe<S: BlockStore, M: StepModel>(
    a: &Args,
    r: &mut SizeRun<S, M>,
    start: Instant,
) -> Result<f64, String> {
    let mut c = trace_config(a, 1000.0 / a.models as f64);
    c.duration_s = a.probe_s;
    c.base_rate = c.peak_rate;
    c.ou_sigma = 0.0;
    c.crowd_rate = 0.0;
    let t = Trace::generate(&c)?;
    let opts = RunOptions {
        drain_s: 0.0,
        sample_s: 1.0,
        budget: r.budget,
    };
    let s = cluster::run(r.gpu, r.models, &t, Policy::Elastic, "probe", opts, r.sync)?;
    let tokens_per_s = s.overall.throughput;
    let unit = trace_config(a, 1.0);
    let demand_per_peak: f64 =
        (0..a.models).map(|m| unit.expected_rate(m)).sum::<f64>() * unit.output_mean;
    let peak = tokens_per_s / demand_per_peak;
    progress(
        start,
        &format!(
            "{}: capacity {tokens_per_s:.0} output tokens/s (probe of {:.0} s, {} preemptions, oom {}): saturation at a peak of {peak:.3} requests/s per model",
            r.name, a.probe_s, s.overall.preemptions, s.overall.oom
        ),
    );
    Ok(peak)
}

fn sweep<S: BlockStore, M: StepModel>(
    a: &Args,
    r: &mut SizeRun<S, M>,
    loads: Option<&Vec<f64>>,
    points: &[usize],
    start: Instant,
) -> Result<Vec<RunSummary>, String> {
    if let Some(path) = &a.trace {
        let t = Trace::load(path)?;
        if t.config.models != r.models.len() {
            return Err(format!(
                "{} is a trace for {} models, not {}",
                path.display(),
                t.config.models,
                r.models.len()
            ));
        }
        return sweep_traces(a, r, vec![(0, t)], start);
    }
    let loads: Vec<f64> = match loads {
        Some(l) => l.clone(),
        None => {
            let sat = probe(a, r, start)?;
            let l: Vec<f64> = FRACTIONS.iter().map(|f| f * sat).collect();
            println!(
                "load points (peak requests/s per model): {}   (to reuse: --loads-{} {})",
                l.iter()
                    .map(|x| format!("{x:.3}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                r.name,
                l.iter()
                    .map(|x| format!("{x:.3}"))
                    .collect::<Vec<_>>()
                    .join(",")
            );
            l
        }
    };
    let dir = a.out.join("traces");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut traces = Vec::new();
    for &p in points.iter().filter(|&&p| p < loads.len()) {
        let t = Trace::generate(&trace_config(a, loads[p]))?;
        t.save(&dir.join(format!("{}-p{p}.json", r.name)))?;
        traces.push((p, t));
    }
    sweep_traces(a, r, traces, start)
}

fn sweep_traces<S: BlockStore, M: StepModel>(
    a: &Args,
    r: &mut SizeRun<S, M>,
    traces: Vec<(usize, Trace)>,
    start: Instant,
) -> Result<Vec<RunSummary>, String> {
    let total = traces.len() * a.policies.len();
    let mut done = Vec::new();
    let mut failed = Vec::new();
    println!("{}", report::header());
    for (p, t) in &traces {
        let p = *p;
        for &policy in &a.policies {
            progress(
                start,
                &format!(
                    "[{}/{total}] {} point {p} (peak {:.3}/s per model, {} requests) {}",
                    done.len() + 1,
                    r.name,
                    t.config.peak_rate,
                    t.requests.len(),
                    policy.name()
                ),
            );
            let label = format!("{}-p{p}", r.name);
            let opts = RunOptions {
                drain_s: a.drain,
                sample_s: 0.25,
                budget: r.budget,
            };
            // A run that fails (a policy that cannot hold the models, a device error) is
            // reported and the sweep goes on: the next run sets its policy afresh.
            let s = match cluster::run(r.gpu, r.models, t, policy, &label, opts, r.sync) {
                Ok(s) => s,
                Err(e) => {
                    println!("{label} {}: FAILED: {e}", policy.name());
                    failed.push(format!("{label} {}: {e}", policy.name()));
                    continue;
                }
            };
            print!("{}", report::lines(&s));
            report::save(&a.out, &s)?;
            if p == 2 {
                report::write_svg(
                    &a.out.join(format!("{label}-{}-memory.svg", policy.name())),
                    &report::memory_svg(&s),
                )?;
            }
            done.push(s);
        }
    }
    if !failed.is_empty() {
        let path = a.out.join(format!("{}-failed.txt", r.name));
        std::fs::write(&path, failed.join("\n")).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    report::write_svg(
        &a.out.join(format!("{}-ttft-p99.svg", r.name)),
        &report::ttft_svg(
            &format!("{} x{}: p99 TTFT against load", r.name, a.models),
            &done,
        ),
    )?;
    Ok(done)
}

/// The sleep goal's experiment on one size (`--sweep-models`): Prism-style traffic (each model
/// bursts, then idles), the number of models grown, each policy's largest count whose p99
/// TTFT meets `--slo`; every run's summary saved under `--out` as it finishes.
fn sweep_models<S: BlockStore, M: StepModel>(
    a: &Args,
    r: &mut SizeRun<S, M>,
    counts: &[usize],
    start: Instant,
) -> Result<(), String> {
    let trace_for = |n: usize| {
        let c = TraceConfig::prism_like(a.seed, n, a.burst_rate, a.duration, a.on_s, a.off_s);
        let t = Trace::generate(&c)?;
        progress(
            start,
            &format!(
                "{} x{n}: {} requests (bursts of {} s at {}/s, then {} s idle, per model)",
                r.name,
                t.requests.len(),
                a.on_s,
                a.burst_rate,
                a.off_s
            ),
        );
        Ok(t)
    };
    let opts = RunOptions {
        drain_s: a.drain,
        sample_s: 0.25,
        budget: r.budget,
    };
    println!(
        "model sweep: {:?} models, SLO p99 TTFT <= {} s; {}",
        counts,
        a.slo_s,
        report::header()
    );
    let out = a.out.clone();
    let slo = a.slo_s;
    let mut on_point = |p: &cluster::SweepPoint| -> Result<(), String> {
        match &p.summary {
            Some(s) => {
                print!("{}", report::lines(s));
                report::save(&out, s)?;
                println!(
                    "{} x{} {}: {} the SLO",
                    r.name,
                    p.models,
                    p.policy.name(),
                    if p.meets { "meets" } else { "misses" }
                );
            }
            None => println!(
                "{} x{} {}: not served: {}",
                r.name,
                p.models,
                p.policy.name(),
                p.error.as_deref().unwrap_or("?")
            ),
        }
        Ok(())
    };
    let points = cluster::model_sweep(
        r.gpu,
        r.models,
        counts,
        &a.policies,
        &trace_for,
        slo,
        r.name,
        opts,
        r.sync,
        &mut on_point,
    )?;
    let served = cluster::served_at_slo(&points);
    let line = served
        .iter()
        .map(|(p, n)| format!("{} {n}", p.name()))
        .collect::<Vec<_>>()
        .join(", ");
    let count = |name: &str| served.iter().find(|(p, _)| p.name() == name).map(|x| x.1);
    let ratio = match (count("static"), count("sleep")) {
        (Some(st), Some(sl)) if st > 0 => {
            format!("; sleep/static {:.2}x (goal 2x)", sl as f64 / st as f64)
        }
        _ => String::new(),
    };
    let verdict = format!(
        "{}: most models served at p99 TTFT <= {} s: {line}{ratio}",
        r.name, a.slo_s
    );
    println!("{verdict}");
    let path = a.out.join(format!("{}-models.txt", r.name));
    std::fs::create_dir_all(&a.out).map_err(|e| format!("{}: {e}", a.out.display()))?;
    std::fs::write(&path, verdict + "\n").map_err(|e| format!("{}: {e}", path.display()))
}

/// The goals of issue 24, checked on one size's runs (printed; not an exit status).
fn verdict(runs: &[RunSummary]) {
    let find = |label: &str, name: &str| {
        runs.iter()
            .find(|r| r.label == label && r.policy.name() == name)
    };
    let mut labels: Vec<&str> = runs.iter().map(|r| r.label.as_str()).collect();
    labels.dedup();
    for label in labels {
        let (Some(st), Some(el)) = (find(label, "static"), find(label, "elastic")) else {
            continue;
        };
        let ratio = st.overall.ttft_p99 / el.overall.ttft_p99;
        let tput = el.overall.throughput / st.overall.throughput;
        let sleep = find(label, "sleep").map_or(String::new(), |s| {
            format!(
                ", sleep p99 {:.3} s ({} sleeps)",
                s.overall.ttft_p99, s.overall.sleeps
            )
        });
        let oom: u64 = runs
            .iter()
            .filter(|r| r.label == label)
            .map(|r| r.overall.oom)
            .sum();
        println!(
            "{label}: p99 TTFT static {:.3} s / elastic {:.3} s = {ratio:.2}x; throughput elastic/static {tput:.3}; finished static {}/{} elastic {}/{}{sleep}; oom {oom}",
            st.overall.ttft_p99,
            el.overall.ttft_p99,
            st.overall.finished,
            st.overall.requests,
            el.overall.finished,
            el.overall.requests
        );
    }
}

fn run_sim(a: &Args, start: Instant) -> Result<(), String> {
    let resident = a.resident.unwrap_or(a.models).clamp(1, a.models);
    let mut sizes = host::HostSizes {
        resident,
        ..host::HostSizes::tiny(a.models, 128 * resident as u64)
    };
    sizes.engine.max_context = a.max_context;
    let (gpu, mut models, _tier) = host::cluster(sizes)?;
    let budget = gpu.global_limit();
    let mut r = SizeRun {
        name: "small",
        gpu: &gpu,
        models: &mut models,
        budget,
        sync: &|| Ok(()),
    };
    progress(
        start,
        &format!(
            "sim: {} models on the host backend, budget {budget} bytes",
            a.models
        ),
    );
    if let Some(counts) = &a.sweep_models {
        sweep_models(a, &mut r, counts, start)?;
    } else {
        let runs = sweep(a, &mut r, a.loads_small.as_ref(), &a.points, start)?;
        verdict(&runs);
    }
    // Every sleep and wake left the weights as they were: each model woken alone (the others
    // asleep: more models than fit may be loaded) and read.
    let policy = cluster::sleep_policy();
    let e = |e: elastic_vmm::Error| e.to_string();
    for m in models.iter().filter(|m| !m.handle.is_asleep()) {
        m.handle.sleep(&policy).map_err(e)?;
    }
    for m in &models {
        m.handle.wake(cluster::AFTER_WAKE).map_err(e)?;
        if !m.engine.model.weights_intact()? {
            return Err(format!(
                "{}: weights changed across sleep and wake",
                m.handle.id()
            ));
        }
        m.handle.sleep(&policy).map_err(e)?;
    }
    progress(
        start,
        "sim: every model's weights intact after its sleeps and wakes",
    );
    Ok(())
}

#[cfg(feature = "candle-example")]
fn run_gpu(a: &Args, start: Instant) -> Result<(), String> {
    for size in &a.sizes {
        let (sz, share, loads, points) = match size.as_str() {
            "small" => (
                llama::Size::Small,
                a.kv_share_small,
                a.loads_small.as_ref(),
                &a.points,
            ),
            "8b" => (
                llama::Size::Llama8B,
                a.kv_share_8b,
                a.loads_8b.as_ref(),
                &a.points_8b,
            ),
            other => return Err(format!("unknown size {other:?}: small or 8b")),
        };
        let gib = |g: f64| (g * (1u64 << 30) as f64) as u64;
        let sizes = llama::GpuSizes {
            size: sz,
            models: a.models,
            resident: a.resident.unwrap_or(a.models),
            kv_share: gib(share),
            budget: a.budget_gib.map(gib),
            engine: engine::EngineConfig {
                max_batch: a.max_batch,
                max_prefill_tokens: a.prefill_chunk as u32,
                max_context: a.max_context,
            },
            prefill_chunk: a.prefill_chunk,
            host_tier: a
                .policies
                .iter()
                .any(|p| matches!(p, Policy::Sleep { .. }))
                .then(|| gib(a.host_gib)),
        };
        let c = llama::cluster(sizes, &|m| progress(start, m))?;
        let device = c.device.clone();
        let sync = move || device.synchronize().map_err(|e| e.to_string());
        let llama::GpuCluster {
            gpu,
            mut models,
            tensor_pools,
            budget,
            tier,
            ..
        } = c;
        progress(
            start,
            &format!(
                "{size}: {} models, budget {:.2} GiB",
                a.models,
                budget as f64 / (1u64 << 30) as f64
            ),
        );
        let mut r = SizeRun {
            name: sz.name(),
            gpu: &gpu,
            models: &mut models,
            budget,
            sync: &sync,
        };
        if let Some(counts) = &a.sweep_models {
            sweep_models(a, &mut r, counts, start)?;
        } else {
            let runs = sweep(a, &mut r, loads, points, start)?;
            verdict(&runs);
        }
        drop(models);
        drop(tensor_pools);
        drop(tier);
    }
    Ok(())
}

#[cfg(not(feature = "candle-example"))]
fn run_gpu(_: &Args, _: Instant) -> Result<(), String> {
    Err("built without the candle-example feature: only --sim runs".into())
}

fn main() -> ExitCode {
    // A child in a role of the process deployment (broker, engine): that and nothing else.
    if let Some(r) = deploy::run_role() {
        return match r {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!(
                    "serve ({}): {e}",
                    std::env::var(deploy::ROLE_VAR).unwrap_or_default()
                );
                ExitCode::FAILURE
            }
        };
    }
    #[cfg(feature = "candle-example")]
    if let Some(r) = restart::run_role() {
        return match r {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("serve restart (child): {e}");
                ExitCode::FAILURE
            }
        };
    }
    let start = Instant::now();
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("restart") {
        #[cfg(feature = "candle-example")]
        let result = restart::run(&argv[2..]);
        #[cfg(not(feature = "candle-example"))]
        let result: Result<(), String> =
            Err("built without the candle-example feature: restart needs the GPU engine".into());
        return match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("serve restart: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if argv.get(1).map(String::as_str) == Some("probe") {
        #[cfg(feature = "candle-example")]
        let result = probe::run(&argv[2..]);
        #[cfg(not(feature = "candle-example"))]
        let result: Result<(), String> =
            Err("built without the candle-example feature: probe needs the GPU engine".into());
        return match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("serve probe: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if argv.get(1).map(String::as_str) == Some("bench") {
        let out = std::env::var_os("OUT")
            .map(|o| PathBuf::from(o).join("serve-bench"))
            .unwrap_or_else(|| PathBuf::from("target/serve-bench"));
        // `serve bench --from DIR[,DIR..] [--out DIR]`: the table, plot and summary of saved
        // runs (a sweep spread over several commands).
        let result = if argv.get(2).map(String::as_str) == Some("--from") {
            match (argv.get(3), argv.get(4).map(String::as_str), argv.get(5)) {
                (Some(dirs), None, None) | (Some(dirs), Some("--out"), Some(_)) => {
                    let out = argv.get(5).map_or(out, PathBuf::from);
                    let dirs: Vec<PathBuf> = dirs.split(',').map(PathBuf::from).collect();
                    bench::from_saved(&dirs, &out).map(|_| ())
                }
                _ => Err("usage: serve bench --from DIR[,DIR..] [--out DIR]".into()),
            }
        } else {
            bench::BenchArgs::parse(&argv[2..], out).and_then(|a| {
                let launcher = deploy::Launcher::this()?;
                bench::run(&a, &launcher, &argv.join(" ")).map(|_| ())
            })
        };
        return match result {
            Ok(()) => {
                progress(start, "done");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("serve bench: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let result = parse().and_then(|a| {
        println!(
            "serve: {} models, {} s traces (+{} s drain), seed {}, policies {:?}, output in {}",
            a.models,
            a.duration,
            a.drain,
            a.seed,
            a.policies.iter().map(|p| p.name()).collect::<Vec<_>>(),
            a.out.display()
        );
        if a.sim {
            run_sim(&a, start)
        } else {
            run_gpu(&a, start)
        }
    });
    match result {
        Ok(()) => {
            progress(start, "done");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("serve: {e}");
            ExitCode::FAILURE
        }
    }
}
