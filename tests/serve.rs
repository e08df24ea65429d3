//! Host tests of the serving benchmark (examples/serve): the trace generator, the scheduler's
//! admission and preemption with a simulated model, a tiny end-to-end run of the three
//! policies on the host backend (real memory, real sleep and wake), the measurement core
//! (censoring, SLO, percentiles, confidence intervals, the knee), the real-trace loaders, and
//! the process deployment (a broker and engine processes, wall clock, open loop) run briefly.
// The benchmark's modules, shared with the GPU binary; not every item is used here.
#![allow(dead_code)]

#[path = "../examples/serve/bench.rs"]
mod bench;
#[path = "../examples/serve/cluster.rs"]
mod cluster;
#[path = "../examples/serve/deploy.rs"]
mod deploy;
#[path = "../examples/serve/engine.rs"]
mod engine;
#[path = "../examples/serve/host.rs"]
mod host;
// The GPU engine, built where the candle example is (every-feature lints).
#[cfg(feature = "candle-example")]
#[path = "../examples/serve/llama.rs"]
mod llama;
#[path = "../examples/serve/metrics.rs"]
mod metrics;
#[cfg(feature = "candle-example")]
#[path = "../examples/serve/paged_llama.rs"]
mod paged_llama;
#[path = "../examples/serve/report.rs"]
mod report;
#[path = "../examples/serve/sleeper.rs"]
mod sleeper;
#[path = "../examples/serve/trace.rs"]
mod trace;
#[path = "../examples/serve/workload.rs"]
mod workload;

use engine::{Engine, EngineConfig, KvBlocks, SeqView, SimCost, StepModel};
use trace::{Request, Trace, TraceConfig};

/// Tests whose models sleep into the page-locked host tier take turns: together they would
/// pass an 8 MiB `RLIMIT_MEMLOCK`.
static LOCKED_TIER: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn tier_turn() -> std::sync::MutexGuard<'static, ()> {
    LOCKED_TIER.lock().unwrap_or_else(|p| p.into_inner())
}

mod trace_tests {
    use super::*;

    #[test]
    fn same_seed_same_trace_other_seed_other_trace() {
        let c = TraceConfig::kvcached_like(42, 3, 2.0, 60.0);
        let a = Trace::generate(&c).unwrap();
        let b = Trace::generate(&c).unwrap();
        assert!(!a.requests.is_empty());
        assert_eq!(a, b);
        let other = Trace::generate(&TraceConfig { seed: 43, ..c }).unwrap();
        assert_ne!(a.requests, other.requests);
    }

    #[test]
    fn saved_trace_replays_equal() {
        let t = Trace::generate(&TraceConfig::kvcached_like(7, 2, 3.0, 30.0)).unwrap();
        let dir = std::env::temp_dir().join(format!("serve-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
        t.save(&path).unwrap();
        let back = Trace::load(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(t, back);
        assert!(t
            .requests
            .windows(2)
            .all(|w| w[0].arrival_us <= w[1].arrival_us));
        assert!(t.requests.iter().enumerate().all(|(i, r)| r.id == i as u64));
    }

    /// Rates and length means within tolerance of the configured values, over long traces.
    #[test]
    fn statistics_match_the_config() {
        // Trend only (no noise, no crowds): the count is Poisson with a known mean.
        let mut c = TraceConfig::kvcached_like(1, 2, 4.0, 2000.0);
        c.period_s = 500.0;
        let plain = TraceConfig {
            ou_sigma: 0.0,
            crowd_rate: 0.0,
            ..c.clone()
        };
        let full = c;
        for (name, c, tol) in [("trend", &plain, 0.05), ("trend+noise+crowds", &full, 0.15)] {
            let t = Trace::generate(c).unwrap();
            for m in 0..c.models {
                let n = of_model(&t, m).count() as f64;
                let want = c.expected_rate(m) * c.duration_s;
                assert!(
                    (n / want - 1.0).abs() < tol,
                    "{name}: model {m}: {n} requests, expected {want:.0} (tolerance {tol})"
                );
            }
            let k = t.requests.len() as f64;
            let prompt = t.requests.iter().map(|r| r.prompt as f64).sum::<f64>() / k;
            let output = t.requests.iter().map(|r| r.output as f64).sum::<f64>() / k;
            assert!(
                (prompt / c.prompt_mean - 1.0).abs() < 0.03,
                "{name}: prompt mean {prompt}"
            );
            assert!(
                (output / c.output_mean - 1.0).abs() < 0.03,
                "{name}: output mean {output}"
            );
        }
        // The trend makes the models take turns: in the first quarter period model 0 ramps up
        // from its floor while model 1 (half a period ahead) is near its peak.
        let t = Trace::generate(&plain).unwrap();
        let early = |m: usize| of_model(&t, m).filter(|r| r.arrival() < 50.0).count();
        assert!(
            early(1) > 5 * early(0),
            "model 0 {} model 1 {}",
            early(0),
            early(1)
        );
    }
}

/// A KV cache that is only a counter of `total` blocks.
#[derive(Debug)]
pub struct CountingKv {
    /// Tokens per block.
    pub block_tokens: u32,
    /// Blocks in all.
    pub total: usize,
    free: Vec<u32>,
}

impl CountingKv {
    /// `total` blocks of `block_tokens` tokens.
    pub fn new(total: usize, block_tokens: u32) -> Self {
        CountingKv {
            block_tokens,
            total,
            free: (0..total as u32).rev().collect(),
        }
    }
}

impl KvBlocks for CountingKv {
    fn block_tokens(&self) -> u32 {
        self.block_tokens
    }
    fn available(&mut self) -> usize {
        self.free.len()
    }
    fn capacity(&self) -> usize {
        self.total
    }
    fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        Some(self.free.split_off(self.free.len() - n))
    }
    fn free(&mut self, ids: &[u32]) {
        self.free.extend_from_slice(ids);
    }
    fn used(&self) -> usize {
        self.total - self.free.len()
    }
}

fn of_model(t: &Trace, model: usize) -> impl Iterator<Item = &Request> {
    t.requests.iter().filter(move |r| r.model == model)
}

/// A simulated model that checks every step's batch: each sequence has the blocks for its
/// context, no block belongs to two sequences, the batch is within its limit.
struct Checked {
    cost: SimCost,
    block_tokens: u32,
    max_batch: usize,
    steps: Vec<(bool, usize)>,
}

impl Checked {
    fn check(&self, seqs: &[SeqView]) {
        assert!(
            !seqs.is_empty() && seqs.len() <= self.max_batch,
            "batch of {}",
            seqs.len()
        );
        let mut seen = std::collections::HashSet::new();
        for s in seqs {
            assert!(
                s.blocks.len() as u64 * self.block_tokens as u64 >= s.context as u64,
                "{} blocks of {} tokens for a context of {}",
                s.blocks.len(),
                self.block_tokens,
                s.context
            );
            for b in s.blocks {
                assert!(seen.insert(*b), "block {b} in two sequences");
            }
        }
    }
}

impl StepModel for Checked {
    fn prefill(&mut self, seqs: &[SeqView]) -> Result<f64, String> {
        self.check(seqs);
        self.steps.push((true, seqs.len()));
        self.cost.prefill(seqs)
    }
    fn decode(&mut self, seqs: &[SeqView]) -> Result<f64, String> {
        self.check(seqs);
        self.steps.push((false, seqs.len()));
        self.cost.decode(seqs)
    }
}

fn req(id: u64, prompt: u32, output: u32) -> Request {
    Request {
        id,
        model: 0,
        arrival_us: 0,
        prompt,
        output,
    }
}

fn engine(blocks: usize, max_batch: usize) -> Engine<CountingKv, Checked> {
    let model = Checked {
        cost: SimCost::small(),
        block_tokens: 16,
        max_batch,
        steps: Vec::new(),
    };
    Engine::new(
        CountingKv::new(blocks, 16),
        model,
        EngineConfig {
            max_batch,
            max_prefill_tokens: 4096,
            max_context: 0,
        },
    )
}

/// Run to completion; returns the time.
fn drain(e: &mut Engine<CountingKv, Checked>) -> f64 {
    let mut now = 0.0;
    for _ in 0..100_000 {
        if !e.has_work() {
            return now;
        }
        let dt = e.step(now);
        assert!(dt > 0.0, "a step with work did nothing: {:?}", e.load());
        now += dt;
    }
    panic!("engine did not finish: {:?}", e.load());
}

mod scheduler_tests {
    use super::*;

    #[test]
    fn admits_only_when_the_blocks_can_be_had() {
        let mut e = engine(10, 8);
        // 100 prompt tokens and the next one: 7 blocks of 16.
        e.submit(req(0, 100, 4));
        e.submit(req(1, 100, 4));
        let dt = e.step(0.0);
        assert!(dt > 0.0);
        assert_eq!(
            e.load(),
            (1, 1),
            "the second request waits for its 7 blocks"
        );
        assert_eq!(e.kv.used(), 7);
        assert_eq!(e.model.steps, vec![(true, 1)]);
        // The first finishes (3 more decode steps), then the second is admitted.
        let end = drain(&mut e);
        assert_eq!(e.finished.len(), 2);
        assert_eq!(e.kv.used(), 0, "every block given back");
        let second = e.finished.iter().find(|f| f.req.id == 1).unwrap();
        let first = e.finished.iter().find(|f| f.req.id == 0).unwrap();
        assert!(
            second.first_token >= first.done,
            "admitted only after the first freed its blocks"
        );
        assert!(end >= second.done);
        assert_eq!(e.counters.preemptions, 0);
        assert_eq!(e.counters.tokens, 8);
    }

    #[test]
    fn a_request_that_can_never_fit_is_refused() {
        let mut e = engine(4, 8);
        e.submit(req(0, 60, 10)); // 70 tokens: 5 blocks of 16, only 4 exist
        assert_eq!(e.counters.refused, 1);
        assert_eq!(e.refused.len(), 1);
        assert!(!e.has_work());
        e.submit(req(1, 40, 10)); // 50 tokens: 4 blocks
        drain(&mut e);
        assert_eq!(e.finished.len(), 1);
    }

    #[test]
    fn decode_without_a_block_preempts_the_newest_and_recomputes_it() {
        // 6 blocks; two requests of 15 prompt tokens each need 1 block to start and 3 at the
        // end (48 tokens): together 6 only at the very end, so the newer one gets preempted.
        let mut e = engine(6, 8);
        e.submit(req(0, 15, 40));
        e.submit(req(1, 15, 40));
        e.submit(req(2, 15, 40));
        let end = drain(&mut e);
        assert!(
            e.counters.preemptions > 0,
            "no preemption: {:?}",
            e.counters
        );
        assert_eq!(e.finished.len(), 3);
        assert_eq!(e.kv.used(), 0);
        // Recomputed tokens are not counted twice; a preempted request keeps its first token.
        assert_eq!(e.counters.tokens, 120);
        let pre: Vec<_> = e.finished.iter().filter(|f| f.preemptions > 0).collect();
        assert!(!pre.is_empty());
        for f in &e.finished {
            assert!(f.first_token <= f.done && f.done <= end);
        }
        // A recompute is a prefill (of the prompt and the tokens generated before) after the
        // first one, which admitted all three.
        let prefills = e.model.steps.iter().filter(|s| s.0).count();
        assert_eq!(
            e.model.steps[0],
            (true, 3),
            "all three admitted in the first prefill"
        );
        assert!(prefills >= 2, "no recompute prefill: {:?}", e.model.steps);
    }

    /// A step that fails (out of memory) is counted, its sequences go back to the queue with
    /// their blocks freed, and they finish once steps work again.
    #[test]
    fn a_failed_step_is_counted_and_its_requests_retried() {
        struct Flaky {
            fail: u32,
        }
        impl StepModel for Flaky {
            fn prefill(&mut self, _: &[SeqView]) -> Result<f64, String> {
                Ok(1e-3)
            }
            fn decode(&mut self, _: &[SeqView]) -> Result<f64, String> {
                if self.fail > 0 {
                    self.fail -= 1;
                    return Err("out of memory (test)".into());
                }
                Ok(1e-3)
            }
        }
        let mut e = Engine::new(
            CountingKv::new(16, 16),
            Flaky { fail: 2 },
            EngineConfig {
                max_batch: 8,
                max_prefill_tokens: 4096,
                max_context: 0,
            },
        );
        e.submit(req(0, 20, 5));
        e.submit(req(1, 20, 5));
        e.step(0.0); // prefill both
        assert_eq!(e.kv.used(), 4);
        assert_eq!(e.step(0.0), 0.0, "a failed step takes no time");
        assert_eq!(e.counters.oom, 1);
        assert_eq!(e.load(), (2, 0), "both back in the queue");
        assert_eq!(e.kv.used(), 0, "their blocks freed");
        assert!(e
            .last_error
            .as_deref()
            .is_some_and(|m| m.contains("out of memory")));
        let mut now = 0.0;
        for _ in 0..100 {
            if !e.has_work() {
                break;
            }
            now += e.step(now);
        }
        assert_eq!(e.counters.oom, 2);
        assert_eq!(e.finished.len(), 2);
        assert_eq!(e.counters.tokens, 10, "recomputed, not regenerated");
        assert_eq!(e.kv.used(), 0);
    }

    /// Many random requests through a small cache: the checks of every step hold, everything
    /// finishes, no block leaks, tokens add up.
    #[test]
    fn random_requests_all_finish_with_the_invariants_held() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for round in 0..20 {
            let blocks = rng.random_range(8..64);
            let mut e = engine(blocks, rng.random_range(1..16));
            let mut want = 0u64;
            let mut accepted = 0;
            for id in 0..rng.random_range(1..60) {
                let (p, o) = (rng.random_range(1..200), rng.random_range(1..200));
                e.submit(req(id, p, o));
                if e.refused.is_empty() {
                    want += o as u64;
                    accepted += 1;
                } else {
                    assert!((p + o).div_ceil(16) as usize > blocks);
                    e.refused.clear();
                }
            }
            drain(&mut e);
            assert_eq!(e.finished.len(), accepted, "round {round}");
            assert_eq!(e.counters.tokens, want, "round {round}");
            assert_eq!(e.kv.used(), 0, "round {round}");
            assert_eq!(e.counters.oom, 0);
        }
    }
}

mod end_to_end {
    use super::*;
    use cluster::{Policy, RunOptions, RunSummary};

    fn trace(peak: f64) -> Trace {
        let mut c = TraceConfig::kvcached_like(42, 3, peak, 20.0);
        c.prompt_mean = 96.0;
        c.output_mean = 96.0;
        c.max_len = 512;
        Trace::generate(&c).unwrap()
    }

    fn run(policy: Policy, t: &Trace) -> (RunSummary, bool) {
        let (gpu, mut models, _tier) = host::cluster(host::HostSizes::tiny(3, 150)).unwrap();
        let opts = RunOptions {
            drain_s: 20.0,
            sample_s: 0.25,
            budget: gpu.global_limit(),
        };
        let s = cluster::run(&gpu, &mut models, t, policy, "host", opts, &|| Ok(())).unwrap();
        let intact = models
            .iter()
            .all(|m| m.engine.model.weights_intact().unwrap());
        let g = gpu.stats().global;
        assert!(g.used <= g.limit);
        assert_eq!(gpu.audit(), Ok(()));
        (s, intact)
    }

    /// The three policies on the host backend (real memory, real sleep and wake) over one
    /// trace: no out-of-memory, every request accounted for, static held to its share, elastic
    /// lets a busy model past it, sleep sleeps and wakes with the weights intact.
    #[test]
    fn three_policies_on_the_host() {
        let _turn = tier_turn();
        let t = trace(4.0);
        let (st, _) = run(Policy::Static, &t);
        let (el, _) = run(Policy::Elastic, &t);
        let (sl, intact) = run(Policy::Sleep { idle_s: 1.0 }, &t);
        for s in [&st, &el, &sl] {
            let o = &s.overall;
            eprintln!(
                "{:<8} finished {:>4}/{:<4} ttft p50 {:>7.3} p99 {:>7.3} s, preemptions {:>4}, peak {:>6} KiB, sleeps {} wakes {} errors {:?}",
                s.policy.name(), o.finished, o.requests, o.ttft_p50, o.ttft_p99, o.preemptions,
                o.peak_bytes >> 10, o.sleeps, o.wakes, s.errors
            );
        }
        for s in [&st, &el, &sl] {
            let o = &s.overall;
            assert_eq!(o.oom, 0, "{}: {:?}", s.policy.name(), s.errors);
            assert_eq!(o.requests, t.requests.len() as u64);
            assert_eq!(
                o.finished + o.unfinished + o.refused,
                o.requests,
                "{}",
                s.policy.name()
            );
            assert!(
                o.finished >= o.requests * 9 / 10,
                "{}: {o:?}",
                s.policy.name()
            );
            assert!(s.errors.is_empty(), "{:?}", s.errors);
        }
        let share = st.kv_budget / 3;
        let sizes = host::HostSizes::tiny(3, 150);
        let base = sizes.weights + sizes.act_reserve;
        for m in &st.models {
            assert!(
                m.peak_bytes <= base + share,
                "static {}: peak {} over {}",
                m.id,
                m.peak_bytes,
                base + share
            );
        }
        assert!(
            el.models.iter().any(|m| m.peak_bytes > base + share),
            "elastic: no model grew past its static share: {:?}",
            el.models.iter().map(|m| m.peak_bytes).collect::<Vec<_>>()
        );
        // Static and elastic run in virtual time only (no wall-clock sleep or wake in them):
        // deterministic for the seed. Above static's knee, shared memory cuts the tail.
        assert!(
            el.overall.ttft_p99 < st.overall.ttft_p99,
            "elastic p99 TTFT {} not below static's {}",
            el.overall.ttft_p99,
            st.overall.ttft_p99
        );
        assert!(
            sl.overall.sleeps > 0 && sl.overall.wakes > 0,
            "{:?}",
            sl.overall
        );
        assert!(intact, "a model's weights changed across sleep and wake");
        // Static's KV never asks the budget; elastic's guarantee follows its KV.
        assert_eq!(st.overall.budget_calls, 0);
        assert!(el.overall.budget_calls > 0);
        assert!(el.overall.steps > 0 && el.overall.decode_batch >= 1.0);
        // Token-weighted mean TPOT lies within the per-request TPOTs' range, and a static
        // partition holds its whole share (held) while using less.
        for s in [&st, &el] {
            let o = &s.overall;
            assert!(o.tpot_mean.is_finite() && o.tpot_mean > 0.0, "{o:?}");
            assert!(o.tpot_mean <= o.tpot_p99 * 1.5, "{o:?}");
        }
        for m in &st.models {
            assert!(
                m.mean_held_bytes >= (base + share) as f64 * 0.99,
                "static {}: holds {} of {}",
                m.id,
                m.mean_held_bytes,
                base + share
            );
        }

        // What a run leaves behind: its summary as JSON (read back whole), the plots.
        let dir = std::env::temp_dir().join(format!("serve-e2e-{}", std::process::id()));
        let path = report::save(&dir, &el).unwrap();
        let back: RunSummary = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(back.overall.finished, el.overall.finished);
        assert_eq!(back.timeline.len(), el.timeline.len());
        assert!(el.timeline.len() > 10);
        let mem = report::memory_svg(&el);
        let ttft = report::ttft_svg("host", &[st.clone(), el.clone(), sl.clone()]);
        for svg in [&mem, &ttft] {
            assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
            assert!(svg.contains("<polyline"));
        }
        assert_eq!(mem.matches("<polyline").count(), 3, "one line per model");
        assert_eq!(ttft.matches("<polyline").count(), 3, "one line per policy");
        assert!(report::lines(&el).lines().count() >= 4);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

mod more_models_than_fit {
    use super::*;
    use cluster::{Policy, RunOptions};

    /// Four models whose weights and activations alone exceed the budget: static and elastic
    /// refuse to run them; sleep serves every request (models start asleep, wake on demand,
    /// idle ones sleep to make room), without an out-of-memory, the budget held, and every
    /// model's weights intact afterwards.
    #[test]
    fn only_sleep_serves_them() {
        let _turn = tier_turn();
        let sizes = host::HostSizes {
            resident: 2,
            ..host::HostSizes::tiny(4, 60)
        };
        let (gpu, mut models, _tier) = host::cluster(sizes).unwrap();
        let bases: u64 = models.iter().map(|m| m.base).sum();
        assert!(
            bases > gpu.global_limit(),
            "the test needs more models than fit"
        );
        let mut c = TraceConfig::kvcached_like(9, 4, 1.0, 20.0);
        c.prompt_mean = 64.0;
        c.output_mean = 64.0;
        c.max_len = 256;
        let t = Trace::generate(&c).unwrap();
        let opts = RunOptions {
            drain_s: 30.0,
            sample_s: 0.25,
            budget: gpu.global_limit(),
        };
        for policy in [Policy::Static, Policy::Elastic] {
            let e = cluster::run(&gpu, &mut models, &t, policy, "over", opts, &|| Ok(()))
                .err()
                .unwrap_or_else(|| panic!("{} ran more models than fit", policy.name()));
            assert!(e.contains("only the sleep policy"), "{e}");
        }
        let policy = Policy::Sleep { idle_s: 0.5 };
        let s = cluster::run(&gpu, &mut models, &t, policy, "over", opts, &|| Ok(())).unwrap();
        let o = &s.overall;
        eprintln!("{o:?} {:?}", s.errors);
        assert_eq!(o.oom, 0, "{:?}", s.errors);
        assert!(s.errors.is_empty(), "{:?}", s.errors);
        assert_eq!(o.finished + o.unfinished + o.refused, o.requests);
        assert_eq!(o.finished, o.requests, "{o:?}");
        assert!(o.wakes >= 4 && o.sleeps > 0, "{o:?}");
        let g = gpu.stats().global;
        assert!(g.used <= g.limit);
        assert_eq!(gpu.audit(), Ok(()));
        // Each model woken alone and read.
        let sleep = cluster::sleep_policy();
        for m in models.iter().filter(|m| !m.handle.is_asleep()) {
            m.handle.sleep(&sleep).unwrap();
        }
        for m in &models {
            m.handle.wake(cluster::AFTER_WAKE).unwrap();
            assert!(
                m.engine.model.weights_intact().unwrap(),
                "{}",
                m.handle.id()
            );
            m.handle.sleep(&sleep).unwrap();
        }
    }
}

mod new_parts {
    use super::*;
    use cluster::{Policy, RunOptions};

    /// Prism-style traffic: each model's arrivals fall in its bursts only, the bursts spread
    /// over the cycle; the same seed gives the same trace.
    #[test]
    fn on_off_traffic_arrives_in_bursts_only() {
        let c = TraceConfig::prism_like(5, 4, 3.0, 200.0, 8.0, 24.0);
        let t = Trace::generate(&c).unwrap();
        assert_eq!(t, Trace::generate(&c).unwrap());
        let cycle = 32.0;
        for m in 0..4 {
            let n = of_model(&t, m).count();
            // 200 s: about 6.25 bursts of 8 s at 3/s (noise has mean 1).
            let want = c.expected_rate(m) * c.duration_s;
            assert!(
                (n as f64 / want - 1.0).abs() < 0.3,
                "model {m}: {n} requests, expected {want:.0}"
            );
            for r in of_model(&t, m) {
                let at = (r.arrival() - m as f64 / 4.0 * cycle).rem_euclid(cycle);
                // Arrivals are placed within a 10 ms step of a burst.
                assert!(
                    at < 8.0 + 0.011,
                    "model {m}: arrival {:.3} s is {at:.3} s into its cycle",
                    r.arrival()
                );
            }
        }
        let bad = TraceConfig {
            on_off: Some(trace::OnOff {
                on_s: 0.0,
                off_s: 1.0,
            }),
            ..c
        };
        assert!(Trace::generate(&bad).is_err());
    }

    /// A request longer than the context the model was sized (warmed) for is refused, not run.
    #[test]
    fn a_request_past_max_context_is_refused() {
        let mut e = Engine::new(
            CountingKv::new(1000, 16),
            SimCost::small(),
            EngineConfig {
                max_batch: 8,
                max_prefill_tokens: 512,
                max_context: 300,
            },
        );
        e.submit(req(0, 200, 100));
        e.submit(req(1, 200, 101));
        assert_eq!(e.counters.refused, 1);
        assert_eq!(e.refused[0].id, 1);
        assert_eq!(e.load(), (1, 0));
    }

    /// Every run starts from the same state: the same trace twice on one cluster gives the
    /// same run (static and elastic run in virtual time), from the same memory.
    #[test]
    fn runs_start_from_the_same_state() {
        let mut c = TraceConfig::kvcached_like(3, 3, 3.0, 10.0);
        c.prompt_mean = 96.0;
        c.output_mean = 64.0;
        c.max_len = 256;
        let t = Trace::generate(&c).unwrap();
        let (gpu, mut models, _tier) = host::cluster(host::HostSizes::tiny(3, 120)).unwrap();
        let opts = RunOptions {
            drain_s: 20.0,
            sample_s: 0.25,
            budget: gpu.global_limit(),
        };
        for policy in [Policy::Elastic, Policy::Static] {
            let a = cluster::run(&gpu, &mut models, &t, policy, "a", opts, &|| Ok(())).unwrap();
            // Memory left mapped after a run (idle, cached) is what the next must not see.
            let left: u64 = models
                .iter()
                .map(|m| m.handle.model_stats().unwrap().used)
                .sum();
            let b = cluster::run(&gpu, &mut models, &t, policy, "b", opts, &|| Ok(())).unwrap();
            assert_eq!(
                a.timeline[0],
                b.timeline[0],
                "{}: start state",
                policy.name()
            );
            assert!(
                a.timeline[0].1.iter().sum::<u64>() <= left,
                "{}: the run started from {:?}, more than the {left} bytes left before",
                policy.name(),
                a.timeline[0].1
            );
            let (x, y) = (&a.overall, &b.overall);
            assert_eq!(x.finished, y.finished);
            assert_eq!(x.ttft_p99, y.ttft_p99, "{}", policy.name());
            assert_eq!(x.tpot_mean, y.tpot_mean, "{}", policy.name());
            assert_eq!(x.peak_bytes, y.peak_bytes, "{}", policy.name());
        }
    }

    /// The sleep goal's experiment on the host: models grown under a budget that holds two;
    /// static serves only as many as it can partition, sleep serves more (idle models sleep
    /// into the shared host tier, which holds their copies); the points past a miss are
    /// skipped; every model's weights intact.
    #[test]
    fn model_sweep_finds_the_most_models_each_policy_serves() {
        let _turn = tier_turn();
        let sizes = host::HostSizes {
            resident: 2,
            ..host::HostSizes::tiny(5, 60)
        };
        let (gpu, mut models, tier) = host::cluster(sizes).unwrap();
        let opts = RunOptions {
            drain_s: 20.0,
            sample_s: 0.25,
            budget: gpu.global_limit(),
        };
        let trace_for = |n: usize| {
            let mut c = TraceConfig::prism_like(11, n, 2.0, 20.0, 3.0, 9.0);
            c.prompt_mean = 64.0;
            c.output_mean = 32.0;
            c.max_len = 128;
            Trace::generate(&c)
        };
        let mut seen = Vec::new();
        let mut max_tier = 0;
        let points = cluster::model_sweep(
            &gpu,
            &mut models,
            &[2, 3, 5, 4],
            &[Policy::Static, Policy::Sleep { idle_s: 0.5 }],
            &trace_for,
            1.0,
            "host",
            opts,
            &|| Ok(()),
            &mut |p| {
                seen.push((p.policy.name(), p.models, p.meets));
                max_tier = max_tier.max(tier.stats().mapped);
                Ok(())
            },
        )
        .unwrap();
        eprintln!("{seen:?}");
        assert_eq!(points.len(), 8, "4 counts (sorted) x 2 policies");
        assert_eq!(
            seen.iter().map(|s| s.1).collect::<Vec<_>>(),
            [2, 3, 4, 5, 2, 3, 4, 5]
        );
        let served = cluster::served_at_slo(&points);
        let of = |n: &str| served.iter().find(|s| s.0.name() == n).unwrap().1;
        assert!(of("static") >= 2, "{served:?}");
        assert!(
            of("static") < 5,
            "static cannot hold 5 models' bases: {served:?}"
        );
        assert_eq!(of("sleep"), 5, "{served:?}");
        // Past static's miss: skipped or refused, never a run that met the SLO.
        let first_miss = points
            .iter()
            .find(|p| p.policy == Policy::Static && !p.meets)
            .unwrap()
            .models;
        for p in points
            .iter()
            .filter(|p| p.policy == Policy::Static && p.models > first_miss)
        {
            assert!(p.summary.is_none() && p.error.as_deref().unwrap().contains("skipped"));
        }
        for p in points.iter().filter_map(|p| p.summary.as_ref()) {
            assert_eq!(p.overall.oom, 0, "{:?}", p.errors);
        }
        assert!(
            max_tier > 0,
            "sleeping models' copies live in the host tier"
        );
        let g = gpu.stats().global;
        assert!(g.used <= g.limit);
        assert_eq!(gpu.audit(), Ok(()));
        let sleep = cluster::sleep_policy();
        for m in models.iter().filter(|m| !m.handle.is_asleep()) {
            m.handle.sleep(&sleep).unwrap();
        }
        for m in &models {
            m.handle.wake(cluster::AFTER_WAKE).unwrap();
            assert!(
                m.engine.model.weights_intact().unwrap(),
                "{}",
                m.handle.id()
            );
            m.handle.sleep(&sleep).unwrap();
        }
    }
}

mod metrics_tests {
    use super::metrics::*;

    #[test]
    fn least_squares_recovers_a_known_plane_and_refuses_a_singular_one() {
        let rows: Vec<Vec<f64>> = [(1.0, 2.0), (3.0, 1.0), (5.0, 7.0), (2.0, 9.0)]
            .iter()
            .map(|&(x, z)| vec![1.0, x, z])
            .collect();
        let y: Vec<f64> = rows.iter().map(|r| 0.5 + 2.0 * r[1] - 3.0 * r[2]).collect();
        let b = least_squares(&rows, &y).unwrap();
        for (got, want) in b.iter().zip([0.5, 2.0, -3.0]) {
            assert!((got - want).abs() < 1e-9, "{b:?}");
        }
        let e = least_squares(&vec![vec![1.0, 1.0]; 3], &[1.0; 3]).unwrap_err();
        assert!(e.contains("singular at column 1"), "{e}");
        let e = least_squares(&rows, &y[..2]).unwrap_err();
        assert!(e.contains("4 rows of 3 columns against 2 values"), "{e}");
    }

    fn rec(
        id: u64,
        arrival: f64,
        first: Option<f64>,
        finish: Option<f64>,
        outcome: Outcome,
    ) -> Record {
        Record {
            model: 0,
            id,
            arrival,
            first_token: first,
            finish,
            prompt: 10,
            output: 11,
            generated: if finish.is_some() {
                11
            } else {
                first.map_or(0, |_| 3)
            },
            outcome,
            preemptions: 0,
        }
    }

    const SLO: Slo = Slo {
        ttft_s: 1.0,
        tpot_s: 0.1,
    };

    /// 100 requests served at once (TTFT 0.1 s, TPOT 0.05 s, all meet the SLO), arriving
    /// over the first 10 s of a 10 s trace; the run ends at 20 s.
    fn served() -> Vec<Record> {
        (0..100)
            .map(|i| {
                let a = i as f64 * 0.1;
                rec(i, a, Some(a + 0.1), Some(a + 0.6), Outcome::Finished)
            })
            .collect()
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.9), 90.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.5), 2.0);
        assert!(percentile(&[], 0.5).is_nan());
    }

    #[test]
    fn all_served_in_time_meet_the_slo() {
        let s = RunStats::of(&served(), &SLO, 10.0, 20.0);
        assert_eq!(
            (s.requests, s.finished, s.censored, s.refused),
            (100, 100, 0, 0)
        );
        assert_eq!(s.slo_attainment, 1.0);
        assert!((s.goodput - 10.0).abs() < 1e-9, "{}", s.goodput);
        assert!((s.ttft_p99 - 0.1).abs() < 1e-9);
        assert!((s.tpot_p50 - 0.05).abs() < 1e-9);
        // 100 requests of 11 tokens over the 20 s run.
        assert!((s.throughput - 55.0).abs() < 1e-9);
    }

    /// Two requests that never got a first token: left out, p99 would be 0.1 s; counted,
    /// censored at the run's end (20 s), they raise p99 to their lower bound.
    #[test]
    fn a_censored_tail_raises_p99() {
        let mut r = served();
        r.truncate(98);
        r.push(rec(98, 9.0, None, None, Outcome::Censored));
        r.push(rec(99, 9.5, None, None, Outcome::Censored));
        let s = RunStats::of(&r, &SLO, 10.0, 20.0);
        assert_eq!(s.censored, 2);
        // Their TTFTs are 11 and 10.5 s; the 99th of 100 values is the smaller.
        assert!((s.ttft_p99 - 10.5).abs() < 1e-9, "p99 {}", s.ttft_p99);
        assert!((s.ttft_p50 - 0.1).abs() < 1e-9);
        assert!((s.slo_attainment - 0.98).abs() < 1e-9);
        // A request censored after its first token: its TPOT is at least what the tokens it
        // has not got would make if they came at the end.
        let late = rec(7, 0.0, Some(0.5), None, Outcome::Censored);
        assert!((late.tpot(20.0).unwrap() - 19.5 / 10.0).abs() < 1e-9);
        assert_eq!(late.ttft(20.0), 0.5);
        assert!(!late.meets(&SLO, 20.0));
    }

    #[test]
    fn a_request_never_served_counts_as_a_miss() {
        let mut r = served();
        r[5] = rec(5, 0.5, None, None, Outcome::Refused);
        r[6] = rec(6, 0.6, None, None, Outcome::Censored);
        let s = RunStats::of(&r, &SLO, 10.0, 20.0);
        assert_eq!((s.finished, s.censored, s.refused), (98, 1, 1));
        assert!((s.slo_attainment - 0.98).abs() < 1e-9);
        assert!((s.goodput - 9.8).abs() < 1e-9);
        // A finished request late by its TTFT or its TPOT misses too.
        let slow_first = rec(0, 0.0, Some(1.5), Some(2.0), Outcome::Finished);
        let slow_decode = rec(1, 0.0, Some(0.1), Some(2.1), Outcome::Finished);
        assert!(!slow_first.meets(&SLO, 20.0));
        assert!(!slow_decode.meets(&SLO, 20.0));
        assert!(rec(2, 0.0, Some(0.1), Some(1.0), Outcome::Finished).meets(&SLO, 20.0));
    }

    #[test]
    fn confidence_interval_of_known_samples() {
        // Mean 3, sample sd sqrt(2.5), n 5: half-width t(4) * sd / sqrt(5) = 2.776 * 0.7071.
        let (m, ci) = mean_ci(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!((m - 3.0).abs() < 1e-12);
        assert!((ci - 2.776 * (2.5f64 / 5.0).sqrt()).abs() < 1e-9, "{ci}");
        // Equal samples: no width; one sample: unbounded; NaN left out.
        assert_eq!(mean_ci(&[0.5, 0.5, 0.5]), (0.5, 0.0));
        assert_eq!(mean_ci(&[2.0]).1, f64::INFINITY);
        let (m, ci) = mean_ci(&[1.0, f64::NAN, 3.0]);
        assert_eq!(m, 2.0);
        assert!((ci - 12.706).abs() < 1e-9);
        assert_eq!(t975(1000), 1.96);
    }

    #[test]
    fn the_knee_is_where_best_static_falls_below_99() {
        let pts = [(1.5, 0.80), (0.5, 1.0), (1.0, 0.98)];
        // Between 0.5 (1.0) and 1.0 (0.98): 0.99 is half way.
        assert!((knee(&pts, 0.99).unwrap() - 0.75).abs() < 1e-12);
        assert_eq!(knee(&[(0.5, 1.0), (1.0, 0.995)], 0.99), None);
        assert_eq!(knee(&[(0.5, 0.9), (1.0, 0.5)], 0.99), Some(0.5));
    }
}

mod workload_tests {
    use super::workload::*;

    const AZURE: &str = "TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.5000000,374,44
2023-11-16 18:15:47.0000000,396,109
2023-11-16 18:16:46.5000000,100,1
";

    const MOONCAKE: &str = r#"{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1]}
{"timestamp": 2500, "input_length": 100, "output_length": 3, "hash_ids": [2]}
"#;

    #[test]
    fn bursts_keep_each_models_on_windows_only() {
        use super::trace::Request;
        let reqs: Vec<Request> = (0..100)
            .map(|i| Request {
                id: i,
                model: 1,
                arrival_us: i * 100_000,
                prompt: 1,
                output: 1,
            })
            .collect();
        // Model 1 of 2, 2 s on and 2 s off: its bursts start at 2 s of each 4 s cycle.
        let kept = bursts(reqs, 1, 2, 2.0, 2.0);
        // Its bursts in 10 s of arrivals every 0.1 s: [2, 4) and [6, 8).
        assert_eq!(kept.len(), 40);
        assert!(kept
            .iter()
            .all(|r| (r.arrival() - 2.0).rem_euclid(4.0) < 2.0));
        assert_eq!(kept[0].arrival_us, 2_000_000);
        assert!(kept.iter().enumerate().all(|(i, r)| r.id == i as u64));
    }

    #[test]
    fn azure_and_mooncake_rows_parse() {
        let a = parse_azure(AZURE).unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!((a[0].t, a[0].prompt, a[0].output), (0.0, 374, 44));
        assert!((a[1].t - 0.5).abs() < 1e-9);
        assert!((a[2].t - 60.0).abs() < 1e-9);
        let m = parse_mooncake(MOONCAKE).unwrap();
        assert_eq!((m[1].t, m[1].prompt, m[1].output), (2.5, 100, 3));
        assert!(parse_azure("TIMESTAMP,ContextTokens,GeneratedTokens\nnot,a,row\n").is_err());
    }

    /// A window replays the trace's own gaps, sped up to the rate asked, for the duration
    /// asked; seeds pick other windows; lengths are scaled and clamped.
    #[test]
    fn a_window_is_the_trace_time_scaled() {
        // One request a second for 1000 s, lengths equal to the index.
        let rows: Vec<Row> = (0..1000)
            .map(|i| Row {
                t: i as f64,
                prompt: i + 1,
                output: 2 * (i + 1),
            })
            .collect();
        let len = Lengths {
            scale: 0.5,
            max_len: 300,
        };
        let w = window(&rows, 1, 7, 10.0, 20.0, len);
        assert_eq!(w.len(), 200, "10 requests a second for 20 s");
        // 200 requests a second apart, sped up to span 20 s: 0.1 s apart.
        let gap_us = 1e5;
        assert!(w.windows(2).all(|p| {
            let gap = (p[1].arrival_us - p[0].arrival_us) as f64;
            (gap - gap_us).abs() <= 2.0
        }));
        assert!(w.iter().all(|r| r.arrival() < 20.0 && r.model == 1));
        assert!(w.iter().enumerate().all(|(i, r)| r.id == i as u64));
        // Lengths: halved, the output cut to 150, the prompt to 300 less the output.
        let first = w[0].prompt;
        for r in &w {
            assert!(r.output <= 150 && r.prompt + r.output <= 300, "{r:?}");
            if r.output < 150 {
                assert!((r.output as i64 - 2 * r.prompt as i64).abs() <= 1, "{r:?}");
            } else {
                assert!(r.prompt >= 75, "{r:?}");
            }
        }
        let l = Lengths {
            scale: 1.0,
            max_len: 100,
        };
        assert_eq!(l.apply(500, 500), (50, 50));
        assert_eq!(l.apply(500, 10), (90, 10));
        assert_eq!(l.apply(0, 0), (1, 1));
        let other = window(&rows, 1, 8, 10.0, 20.0, len);
        assert_ne!(other[0].prompt, first, "another seed, another window");
        // A bursty trace (a burst of 100 in 1 s, then one request a second): every window
        // offers the load asked, bursts kept in proportion inside it.
        let bursty: Vec<Row> = (0..100)
            .map(|i| i as f64 * 0.01)
            .chain((1..900).map(|i| i as f64))
            .map(|t| Row {
                t,
                prompt: 10,
                output: 10,
            })
            .collect();
        for seed in 0..20 {
            let w = window(&bursty, 0, seed, 2.0, 30.0, len);
            assert_eq!(w.len(), 60, "seed {seed}");
            assert!(w.iter().all(|r| r.arrival() < 30.0), "seed {seed}");
        }
        // A window of requests at one instant is spread evenly over the run.
        let instant: Vec<Row> = (0..50)
            .map(|_| Row {
                t: 3.0,
                prompt: 10,
                output: 10,
            })
            .collect();
        let spread = window(&instant, 0, 1, 1.0, 10.0, len);
        assert_eq!(spread.len(), 10);
        assert!(spread
            .iter()
            .enumerate()
            .all(|(i, r)| r.arrival_us == i as u64 * 1_000_000));
        // The whole trace at its own rate is the whole trace.
        let all = window(&rows, 0, 0, 1000.0 / 999.0, 999.0, len);
        assert_eq!(all.len(), 1000);
        assert_eq!(
            window(&rows, 1, 7, 10.0, 20.0, len),
            w,
            "the same seed, the same window"
        );
    }

    #[test]
    fn synthetic_traces_come_at_the_mean_rate_asked() {
        let len = Lengths {
            scale: 1.0,
            max_len: 2048,
        };
        let t = synthetic(3, 42, 2.0, 300.0, len).unwrap();
        let n: usize = t.iter().map(Vec::len).sum();
        let rate = n as f64 / 3.0 / 300.0;
        assert!((1.5..2.5).contains(&rate), "rate {rate}");
        assert!(t
            .iter()
            .enumerate()
            .all(|(m, r)| r.iter().all(|q| q.model == m)));
    }

    /// The real traces beside the repository, when there (`../shared/traces`): each loads
    /// whole, at the rate its README gives.
    #[test]
    fn real_traces_load_when_present() {
        let dir = super::bench::default_traces_dir();
        if !dir.join("README.md").exists() {
            eprintln!("no traces at {}: skipped", dir.display());
            return;
        }
        for (src, n) in [
            (Source::AzureConv, 19_366),
            (Source::AzureCode, 8_819),
            (Source::Mooncake, 12_031),
        ] {
            let rows = load(&dir, src).unwrap();
            assert_eq!(rows.len(), n, "{}", src.name());
            let (span, _) = span_rate(&rows);
            assert!(
                (3_000.0..3_600.0).contains(&span),
                "{} spans {span} s",
                src.name()
            );
        }
    }
}

mod deploy_tests {
    use super::deploy::*;
    use super::metrics::{Outcome, RunStats, Slo};
    use super::trace::Request;

    /// The process deployment's roles, run by this test binary re-executed (the driver passes
    /// this test's name and the role in the environment). Run without a role it does nothing:
    /// it is the children's entry point, not a test.
    #[test]
    fn role_child() {
        if let Some(r) = run_role() {
            if let Err(e) = r {
                eprintln!("role failed: {e}");
                std::process::exit(1);
            }
            std::process::exit(0);
        }
    }

    fn launcher() -> Launcher {
        Launcher {
            exe: std::env::current_exe().unwrap(),
            args: [
                "--exact",
                "deploy_tests::role_child",
                "--nocapture",
                "--test-threads",
                "1",
            ]
            .map(String::from)
            .to_vec(),
        }
    }

    #[test]
    fn static_shares_split_by_weight_above_a_floor() {
        assert_eq!(static_shares(100, &[1.0, 1.0], 0), vec![50, 50]);
        assert_eq!(static_shares(100, &[3.0, 1.0], 10), vec![70, 30]);
        assert_eq!(static_shares(100, &[1.0, 0.0, 0.0], 10), vec![80, 10, 10]);
        assert_eq!(static_shares(90, &[0.0, 0.0, 0.0], 10), vec![30, 30, 30]);
        // A floor larger than an equal share is cut to it.
        assert_eq!(static_shares(30, &[1.0, 1.0, 1.0], 50), vec![10, 10, 10]);
    }

    /// Model 0 gets a burst of requests whose contexts fill twice its equal share; model 1
    /// gets none. Under `elastic` model 0 grows past its share through the broker (the other
    /// engine holds nothing above its guarantee), under `static-equal` it is held to it and
    /// its queue waits longer; every request of the trace has a record either way.
    fn burst_point(policy: DeployPolicy) -> Point {
        let mut sizes = DeploySizes::small(2);
        sizes.kv_blocks = 128; // 64 blocks (2,048 tokens) each under an equal split
        let burst: Vec<Request> = (0..12)
            .map(|i| Request {
                id: i,
                model: 0,
                arrival_us: i * 20_000,
                prompt: 600,
                output: 40,
            })
            .collect();
        Point {
            policy,
            sizes,
            requests: vec![burst, Vec::new()],
            demand: vec![1.0, 0.0],
            duration_s: 0.5,
            drain_s: 1.5,
            reclaim_wait_ms: 200,
            sleep_idle_s: 1.0,
        }
    }

    #[test]
    fn processes_under_one_broker_serve_on_wall_clock() {
        let slo = Slo {
            ttft_s: 10.0,
            tpot_s: 1.0,
        };
        let mut seen = Vec::new();
        // One deployment serves both runs: the driver lowers model 0's limit from the whole KV
        // budget (elastic) to its share (static) between them, through the broker.
        let first = burst_point(DeployPolicy::Elastic);
        let mut d =
            Deployment::start(&launcher(), &first.sizes, 2, first.reclaim_wait_ms, false).unwrap();
        for policy in [DeployPolicy::Elastic, DeployPolicy::StaticEqual] {
            let p = burst_point(policy);
            let r = d.run(&p).unwrap();
            assert_eq!(r.engines.len(), 2);
            let recs = r.records();
            // Every request is accounted for, once.
            let mut ids: Vec<u64> = recs.iter().filter(|x| x.model == 0).map(|x| x.id).collect();
            ids.sort_unstable();
            assert_eq!(ids, (0..12).collect::<Vec<_>>(), "{}", policy.name());
            assert!(r.engines[1].records.is_empty());
            let step = p.sizes.cost.step_s;
            for x in &recs {
                // Wall clock: a first token comes at least one step of simulated compute
                // after its arrival, the last 39 decode steps after the first.
                if let Some(f) = x.first_token {
                    assert!(f - x.arrival >= step, "{x:?}");
                }
                if x.outcome == Outcome::Finished {
                    let decode = x.finish.unwrap() - x.first_token.unwrap();
                    assert!(decode >= 39.0 * step, "{x:?}");
                }
            }
            let st = RunStats::of(&recs, &slo, p.duration_s, r.end_s);
            assert_eq!(st.requests, 12);
            assert_eq!(st.finished + st.censored + st.refused, 12);
            assert_eq!(st.refused, 0);
            assert!(
                r.engines.iter().all(|e| e.errors.is_empty()),
                "{:?}",
                r.engines
            );
            seen.push((policy, r.engines[0].peak_blocks, st));
        }
        d.stop().unwrap();
        let (_, elastic_peak, el) = &seen[0];
        let (_, static_peak, stc) = &seen[1];
        // 19 blocks a request (600 + 40 tokens of 32): three fit an equal share of 64.
        assert!(*static_peak <= 64, "static held {static_peak} blocks");
        assert!(
            *elastic_peak > 64,
            "elastic held only {elastic_peak} blocks"
        );
        assert!(
            el.ttft_p90 < stc.ttft_p90,
            "elastic p90 TTFT {} s, static {} s",
            el.ttft_p90,
            stc.ttft_p90
        );
    }

    /// Three models on a budget with room for two bases: model `m`'s four requests arrive
    /// at `starts[m]` seconds.
    fn turns_point(policy: DeployPolicy, starts: [f64; 3]) -> Point {
        let mut sizes = DeploySizes::small(3);
        sizes.resident = 2;
        sizes.kv_blocks = 128;
        let requests = starts
            .iter()
            .enumerate()
            .map(|(m, &t)| {
                (0..4)
                    .map(|i| Request {
                        id: i,
                        model: m,
                        arrival_us: (t * 1e6) as u64 + i * 10_000,
                        prompt: 200,
                        output: 20,
                    })
                    .collect()
            })
            .collect();
        Point {
            policy,
            sizes,
            requests,
            demand: vec![1.0; 3],
            duration_s: 2.0,
            drain_s: 2.0,
            reclaim_wait_ms: 200,
            sleep_idle_s: 0.1,
        }
    }

    /// More models than the budget holds: the engines load one by one, each asleep before
    /// the next; in a run each sleeps when idle and wakes for its requests (the wake inside
    /// their TTFT), and a wake the budget has no room for waits until another model sleeps.
    /// Every request is served; the weights come back intact after each wake (the engines
    /// check them after every run).
    #[test]
    fn sleeping_models_take_turns_beyond_what_the_budget_holds() {
        let slo = Slo {
            ttft_s: 10.0,
            tpot_s: 1.0,
        };
        let first = turns_point(DeployPolicy::ElasticSleep, [0.0; 3]);
        // Not for sleep-less policies, with more models than fit.
        assert!(
            Deployment::start(&launcher(), &first.sizes, 3, 200, false).is_err(),
            "three models with room for two bases started without sleeps"
        );
        let mut d = Deployment::start(&launcher(), &first.sizes, 3, 200, true).unwrap();
        let refused = d.run(&turns_point(DeployPolicy::Elastic, [0.0; 3]));
        assert!(refused.unwrap_err().contains("2 resident"));
        // Apart, then all three at once.
        for (policy, starts) in [
            (DeployPolicy::ElasticSleep, [0.0, 0.6, 1.2]),
            (DeployPolicy::StaticSleep, [0.0, 0.6, 1.2]),
            (DeployPolicy::StaticSleep, [0.0, 0.0, 0.0]),
            (DeployPolicy::ElasticSleep, [0.0, 0.0, 0.0]),
        ] {
            let p = turns_point(policy, starts);
            let r = d.run(&p).unwrap();
            let name = format!("{} {starts:?}", policy.name());
            let st = RunStats::of(&r.records(), &slo, p.duration_s, r.end_s);
            assert_eq!(
                (st.requests, st.finished),
                (12, 12),
                "{name}: {:?}",
                r.engines
            );
            for e in &r.engines {
                assert!(e.errors.is_empty(), "{name}: {e:?}");
                assert!(
                    e.wakes >= 1 && e.wake_s > 0.0,
                    "{name}: model {} never woke",
                    e.model
                );
                // Apart, each model went back to sleep once idle.
                if starts[1] > 0.0 {
                    assert!(e.sleeps >= 1, "{name}: model {} never slept", e.model);
                }
            }
            if starts[1] > 0.0 {
                // All asleep at the end: the broker holds nothing of any base, and of any KV
                // cache only its zero page (memory given back, not only guarantees).
                let snap = d.snapshot().unwrap();
                for m in &snap.models {
                    let (most, what) = match m.name.ends_with("-kv") {
                        true => (p.sizes.zero_page, "its zero page"),
                        false => (0, "nothing"),
                    };
                    assert!(
                        m.used <= most,
                        "{name}: asleep, {} holds {} bytes, not {what}",
                        m.name,
                        m.used
                    );
                    assert!(
                        m.guarantee <= most,
                        "{name}: asleep, {} keeps a guarantee of {}",
                        m.name,
                        m.guarantee
                    );
                }
            }
            let refused: u64 = r.engines.iter().map(|e| e.wakes_waited).sum();
            if policy == DeployPolicy::StaticSleep && starts[1] == 0.0 {
                // Two bases and two static shares fill the budget: the third waited.
                assert!(refused >= 1, "{name}: three awake at once: {:?}", r.engines);
            }
            if policy == DeployPolicy::ElasticSleep && starts[1] == 0.0 {
                // The KV budget not in use has room for the third base: no wake waited.
                assert_eq!(refused, 0, "{name}: {:?}", r.engines);
            }
        }
        d.stop().unwrap();
    }
}

mod bench_tests {
    use super::bench::{attainment_svg, per_model_table, summarise, table};
    use super::metrics::{RunStats, Slo};

    /// The table per model: each model's attainment averaged over the seeds of one load and
    /// policy, headed by its trace, so a reader sees which model's requests miss.
    #[test]
    fn the_table_per_model_says_which_model_misses() {
        let run = |a: f64, b: f64| {
            vec![
                ("conv".to_string(), stats(a, 0.5)),
                ("mooncake".to_string(), stats(b, 3.0)),
            ]
        };
        let per = vec![
            (0.5, "elastic".to_string(), run(1.0, 0.5)),
            (0.5, "elastic".to_string(), run(1.0, 0.0)),
            (0.5, "static-best".to_string(), run(0.5, 0.0)),
        ];
        let text = per_model_table(&per);
        assert!(
            text.contains("0 conv") && text.contains("1 mooncake"),
            "{text}"
        );
        let line = |policy: &str| {
            text.lines()
                .find(|l| l.split_whitespace().next() == Some(policy))
                .unwrap_or_else(|| panic!("no {policy} line in {text}"))
                .to_string()
        };
        // Elastic: conv 1.0 both seeds, mooncake 0.5 and 0.0: mean 0.25.
        assert!(line("elastic").contains("1.000±0.000"), "{text}");
        assert!(line("elastic").contains("0.250±"), "{text}");
        // One seed: no interval to compute, the mean stands.
        assert!(line("static-best").contains("0.500±"), "{text}");
        assert!(per_model_table(&[(1.0, "elastic".into(), Vec::new())]).is_empty());
    }

    fn stats(slo: f64, p99: f64) -> RunStats {
        RunStats {
            slo_attainment: slo,
            ttft_p99: p99,
            ..RunStats::default()
        }
    }

    /// Cells hold each metric's mean and CI over the seeds of one load and policy; the knee is
    /// read off the best static policy at each load, not off elastic.
    #[test]
    fn cells_and_the_knee_over_seeds() {
        let mut runs = Vec::new();
        for (load, eq, best, el) in [
            (0.5, [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]),
            (1.0, [0.90, 0.94], [0.98, 0.98], [1.0, 1.0]),
            (1.5, [0.5, 0.7], [0.6, 0.8], [0.99, 1.0]),
        ] {
            for i in 0..2 {
                runs.push((
                    load,
                    "static-equal".to_string(),
                    stats(eq[i], 1.0 + i as f64),
                ));
                runs.push((load, "static-best".to_string(), stats(best[i], 2.0)));
                runs.push((load, "elastic".to_string(), stats(el[i], 0.5)));
            }
        }
        let (cells, knee) = summarise(&runs);
        assert_eq!(cells.len(), 9);
        let c = cells
            .iter()
            .find(|c| c.load == 1.5 && c.policy == "static-equal")
            .unwrap();
        assert_eq!(c.runs, 2);
        let (name, mean, ci) = &c.metrics[0];
        assert_eq!(name, "slo");
        assert!((mean - 0.6).abs() < 1e-12);
        // Two samples 0.2 apart: sd 0.1414, t(1) 12.706, half-width 12.706 * 0.1.
        assert!((ci - 1.2706).abs() < 1e-9, "{ci}");
        let p99 = c.metrics.iter().find(|m| m.0 == "ttft p99").unwrap();
        assert!((p99.1 - 1.5).abs() < 1e-12);
        // Best static: 1.0 at 0.5, 0.98 at 1.0: below 99% half way between 0.5 and 1.0.
        assert!((knee.unwrap() - 0.75).abs() < 1e-12, "{knee:?}");
        let slo = Slo {
            ttft_s: 1.0,
            tpot_s: 0.05,
        };
        let t = table(&cells, &slo);
        assert!(
            t.contains("TTFT <= 1 s") && t.contains("0.600±1.271"),
            "{t}"
        );
        assert_eq!(attainment_svg(&cells, &slo).matches("<polyline").count(), 3);
    }
}

/// The host simulation's shared device (`DeploySizes::shared_device`): engines whose steps
/// overlap take turns, as engine processes time-slicing one GPU do; without it they overlap.
mod shared_device_tests {
    use std::time::{Duration, Instant};

    use elastic_vmm::Pool;

    use crate::engine::{SimCost, StepModel};
    use crate::host::SimModel;

    fn model(device: Option<std::fs::File>) -> SimModel {
        let pool = Pool::host(64 << 20).expect("host pool");
        let weights = pool.allocate(64 << 10).expect("weights");
        SimModel {
            pool,
            cost: SimCost {
                step_s: 0.1,
                prefill_token_s: 0.0,
                decode_seq_s: 0.0,
                context_token_s: 0.0,
            },
            act_bytes_per_token: 1,
            weights,
            pattern: 0,
            wall: true,
            device,
        }
    }

    /// Wall time of two engines stepping once at the same moment.
    fn two_at_once(shared: bool) -> Duration {
        let dir = std::env::temp_dir().join(format!("serve-device-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join(format!("device-{shared}"));
        let open = || {
            shared.then(|| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&path)
                    .expect("device file")
            })
        };
        let mut models = [model(open()), model(open())];
        let barrier = std::sync::Barrier::new(3);
        // Timed from when both threads are ready to when both are done (the scope joins them).
        let t = std::thread::scope(|s| {
            for m in &mut models {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    m.decode(&[]).expect("step");
                });
            }
            barrier.wait();
            Instant::now()
        });
        let took = t.elapsed();
        let _ = std::fs::remove_dir_all(&dir);
        took
    }

    #[test]
    fn engines_on_one_simulated_device_take_turns() {
        let shared = two_at_once(true);
        let apart = two_at_once(false);
        assert!(
            shared >= Duration::from_millis(198),
            "two 100 ms steps on one device took {shared:?}"
        );
        assert!(
            apart < Duration::from_millis(190),
            "two 100 ms steps without a shared device took {apart:?}"
        );
    }
}
