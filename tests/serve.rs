//! Host tests of the serving benchmark (examples/serve): the trace generator, the scheduler's
//! admission and preemption with a simulated model, and a tiny end-to-end run of the three
//! policies on the host backend (real memory, real sleep and wake).
// The benchmark's modules, shared with the GPU binary; not every item is used here.
#![allow(dead_code)]

#[path = "../examples/serve/trace.rs"]
mod trace;

use trace::{Trace, TraceConfig};

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
                let n = t.of_model(m).count() as f64;
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
        let early = |m: usize| t.of_model(m).filter(|r| r.arrival() < 50.0).count();
        assert!(
            early(1) > 5 * early(0),
            "model 0 {} model 1 {}",
            early(0),
            early(1)
        );
    }
}
