//! Host tests of the serving benchmark (examples/serve): the trace generator, the scheduler's
//! admission and preemption with a simulated model, and a tiny end-to-end run of the three
//! policies on the host backend (real memory, real sleep and wake).
// The benchmark's modules, shared with the GPU binary; not every item is used here.
#![allow(dead_code)]

#[path = "../examples/serve/cluster.rs"]
mod cluster;
#[path = "../examples/serve/engine.rs"]
mod engine;
#[path = "../examples/serve/host.rs"]
mod host;
#[path = "../examples/serve/report.rs"]
mod report;
#[path = "../examples/serve/trace.rs"]
mod trace;

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
