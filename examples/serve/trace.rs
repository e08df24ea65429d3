//! Seeded request traces: per model an inhomogeneous Poisson process whose rate has a trend
//! (each model ramps up to its peak and back, models out of phase, as in kvcached's ramping
//! benchmark), multiplicative Ornstein-Uhlenbeck noise and clustered flash crowds (events at
//! `crowd_rate` per second, each a cluster of bursts decaying with `crowd_decay_s`), prompt and
//! output lengths lognormal around their means. A trace is saved and replayed as JSON.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal, Normal, Poisson};
use serde::{Deserialize, Serialize};

/// Rate is evaluated on this grid (seconds); arrivals are uniform within a step.
const DT: f64 = 0.01;

/// What a trace is generated from. The same config and seed give the same trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceConfig {
    /// Generator seed.
    pub seed: u64,
    /// Trace length (seconds).
    pub duration_s: f64,
    /// Number of models.
    pub models: usize,
    /// Each model's peak rate of its trend (requests per second).
    pub peak_rate: f64,
    /// Rate outside the ramp (requests per second), the floor of the trend.
    pub base_rate: f64,
    /// Period of one ramp 0 -> peak -> 0 (seconds); model `i` is shifted by `i / models`
    /// periods, so the models' peaks take turns.
    pub period_s: f64,
    /// Noise: the rate is multiplied by `exp(sigma X - sigma^2 / 2)`, X a unit OU process.
    pub ou_sigma: f64,
    /// OU mean-reversion time (seconds).
    pub ou_tau_s: f64,
    /// Flash-crowd events per second per model.
    pub crowd_rate: f64,
    /// Mean extra bursts per event (Poisson), each within `crowd_spread_s` of the event.
    pub crowd_cluster: f64,
    /// Spread of a cluster's bursts after its event (seconds).
    pub crowd_spread_s: f64,
    /// A burst's added rate at its start, as a multiple of `peak_rate`; it decays with
    /// `crowd_decay_s`.
    pub crowd_gain: f64,
    /// Burst decay time constant (seconds).
    pub crowd_decay_s: f64,
    /// Prompt length: lognormal with this mean (tokens) ...
    pub prompt_mean: f64,
    /// ... and this sigma of its logarithm.
    pub prompt_sigma: f64,
    /// Output length: lognormal with this mean (tokens) ...
    pub output_mean: f64,
    /// ... and this sigma of its logarithm.
    pub output_sigma: f64,
    /// Lengths are clamped to `1..=max_len`.
    pub max_len: u32,
    /// Bursts then idle periods instead of the ramp (Prism's production traces: most models
    /// idle for long stretches): `None` for the ramp.
    #[serde(default)]
    pub on_off: Option<OnOff>,
}

/// A model's trend as bursts at the peak rate and idle periods at the base rate (Prism-style:
/// each model bursts, then idles longer than a sleep's idle time).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OnOff {
    /// Seconds of a burst (at `peak_rate`).
    pub on_s: f64,
    /// Seconds idle after it (at `base_rate`).
    pub off_s: f64,
}

impl TraceConfig {
    /// The workload of kvcached's fuller benchmark (flash crowds at 0.03 events/s with 6 s decay,
    /// 256-token prompts, 512-token outputs), `models` models at `peak_rate` each.
    pub fn kvcached_like(seed: u64, models: usize, peak_rate: f64, duration_s: f64) -> Self {
        TraceConfig {
            seed,
            duration_s,
            models,
            peak_rate,
            base_rate: 0.05 * peak_rate,
            period_s: duration_s,
            ou_sigma: 0.3,
            ou_tau_s: 5.0,
            crowd_rate: 0.03,
            crowd_cluster: 1.0,
            crowd_spread_s: 3.0,
            crowd_gain: 1.0,
            crowd_decay_s: 6.0,
            prompt_mean: 256.0,
            prompt_sigma: 0.4,
            output_mean: 512.0,
            output_sigma: 0.6,
            max_len: 2048,
            on_off: None,
        }
    }

    /// Prism-style traffic of `models` models: each bursts at `peak_rate` for `on_s` seconds,
    /// then idles `off_s` seconds (no arrivals), the models' bursts spread evenly over the
    /// cycle; 256-token prompts, 128-token outputs (chat turns: a burst is over soon after its
    /// last arrival), no flash crowds (the bursts are the crowds), mild noise.
    pub fn prism_like(
        seed: u64,
        models: usize,
        peak_rate: f64,
        duration_s: f64,
        on_s: f64,
        off_s: f64,
    ) -> Self {
        TraceConfig {
            base_rate: 0.0,
            period_s: on_s + off_s,
            ou_sigma: 0.2,
            crowd_rate: 0.0,
            output_mean: 128.0,
            on_off: Some(OnOff { on_s, off_s }),
            ..Self::kvcached_like(seed, models, peak_rate, duration_s)
        }
    }

    /// The trend's rate of `model` at `t` (no noise, no crowds).
    pub fn trend(&self, model: usize, t: f64) -> f64 {
        let phase = t / self.period_s + model as f64 / self.models.max(1) as f64;
        if let Some(o) = self.on_off {
            // Model i's burst starts i / models of a cycle in (model 0's at t = 0).
            let cycle = o.on_s + o.off_s;
            let at = (t - model as f64 / self.models.max(1) as f64 * cycle).rem_euclid(cycle);
            return if at < o.on_s {
                self.peak_rate
            } else {
                self.base_rate
            };
        }
        let ramp = 0.5 * (1.0 - (2.0 * std::f64::consts::PI * phase).cos());
        self.base_rate + (self.peak_rate - self.base_rate).max(0.0) * ramp
    }

    /// The expected mean arrival rate of one model over the trace (requests per second): the
    /// trend's mean (the noise has mean 1) plus the crowds' expected contribution.
    pub fn expected_rate(&self, model: usize) -> f64 {
        let steps = (self.duration_s / DT).ceil() as usize;
        let trend: f64 = (0..steps)
            .map(|k| self.trend(model, (k as f64 + 0.5) * DT))
            .sum::<f64>()
            / steps.max(1) as f64;
        // Each burst adds gain * peak * tau (less what decays past the end; ignored).
        let bursts = self.crowd_rate * (1.0 + self.crowd_cluster);
        trend + bursts * self.crowd_gain * self.peak_rate * self.crowd_decay_s
    }
}

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Index in the trace (arrival order).
    pub id: u64,
    /// The model it is for.
    pub model: usize,
    /// Arrival time (microseconds from the start: an integer, so a replay is exact).
    pub arrival_us: u64,
    /// Prompt tokens.
    pub prompt: u32,
    /// Tokens to generate.
    pub output: u32,
}

impl Request {
    /// Arrival time in seconds.
    pub fn arrival(&self) -> f64 {
        self.arrival_us as f64 / 1e6
    }
}

/// A generated trace: its config and its requests in arrival order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    /// What it was generated from.
    pub config: TraceConfig,
    /// Requests, sorted by arrival.
    pub requests: Vec<Request>,
}

fn lognormal(mean: f64, sigma: f64) -> Result<LogNormal<f64>, String> {
    // Mean of a lognormal is exp(mu + sigma^2 / 2).
    LogNormal::new(mean.max(1.0).ln() - sigma * sigma / 2.0, sigma)
        .map_err(|e| format!("lognormal(mean {mean}, sigma {sigma}): {e}"))
}

fn clamp_len(x: f64, max: u32) -> u32 {
    (x.round().max(1.0) as u32).min(max.max(1))
}

impl Trace {
    /// Generate the trace of `config`.
    pub fn generate(config: &TraceConfig) -> Result<Trace, String> {
        if config
            .on_off
            .is_some_and(|o| !(o.on_s > 0.0 && o.off_s >= 0.0))
        {
            return Err(format!(
                "bursts of {:?}: on_s must be positive and off_s at least 0",
                config.on_off
            ));
        }
        if !(config.duration_s > 0.0 && config.period_s > 0.0 && config.ou_tau_s > 0.0) {
            return Err(format!(
                "duration {} s, period {} s and OU tau {} s must be positive",
                config.duration_s, config.period_s, config.ou_tau_s
            ));
        }
        let normal = Normal::new(0.0, 1.0).map_err(|e| e.to_string())?;
        let prompt = lognormal(config.prompt_mean, config.prompt_sigma)?;
        let output = lognormal(config.output_mean, config.output_sigma)?;
        let steps = (config.duration_s / DT).ceil() as usize;
        let mut requests = Vec::new();
        for model in 0..config.models {
            // One stream per model: adding a model leaves the others' arrivals as they were.
            let mut rng = StdRng::seed_from_u64(
                config.seed ^ (model as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            // Flash crowds: events, each with a cluster of bursts after it.
            let mut bursts = Vec::new();
            let events = Poisson::new(config.crowd_rate * config.duration_s + 1e-12)
                .map_err(|e| e.to_string())?
                .sample(&mut rng) as usize;
            for _ in 0..events {
                let at = rng.random::<f64>() * config.duration_s;
                bursts.push(at);
                let extra = if config.crowd_cluster > 0.0 {
                    Poisson::new(config.crowd_cluster)
                        .map_err(|e| e.to_string())?
                        .sample(&mut rng) as usize
                } else {
                    0
                };
                for _ in 0..extra {
                    bursts.push(at + rng.random::<f64>() * config.crowd_spread_s);
                }
            }
            // OU noise, started from its stationary distribution (unit variance).
            let mut x: f64 = normal.sample(&mut rng);
            let decay = (-DT / config.ou_tau_s).exp();
            let kick = (1.0 - decay * decay).sqrt();
            let s = config.ou_sigma;
            for k in 0..steps {
                let t = k as f64 * DT;
                x = x * decay + kick * normal.sample(&mut rng);
                let crowd: f64 = bursts
                    .iter()
                    .filter(|&&b| b <= t)
                    .map(|&b| (-(t - b) / config.crowd_decay_s).exp())
                    .sum::<f64>()
                    * config.crowd_gain
                    * config.peak_rate;
                let rate = config.trend(model, t + DT / 2.0) * (s * x - s * s / 2.0).exp() + crowd;
                let n = if rate > 0.0 {
                    Poisson::new(rate * DT)
                        .map_err(|e| e.to_string())?
                        .sample(&mut rng) as usize
                } else {
                    0
                };
                for _ in 0..n {
                    let arrival = (t + rng.random::<f64>() * DT).min(config.duration_s);
                    requests.push(Request {
                        id: 0,
                        model,
                        arrival_us: (arrival * 1e6) as u64,
                        prompt: clamp_len(prompt.sample(&mut rng), config.max_len),
                        output: clamp_len(output.sample(&mut rng), config.max_len),
                    });
                }
            }
        }
        requests.sort_by_key(|r| (r.arrival_us, r.model));
        for (i, r) in requests.iter_mut().enumerate() {
            r.id = i as u64;
        }
        Ok(Trace {
            config: config.clone(),
            requests,
        })
    }

    /// Save as JSON.
    pub fn save(&self, path: &std::path::Path) -> Result<(), String> {
        let json = serde_json::to_vec(self).map_err(|e| e.to_string())?;
        std::fs::write(path, json).map_err(|e| format!("writing {}: {e}", path.display()))
    }

    /// Load a trace saved by [`Trace::save`].
    pub fn load(path: &std::path::Path) -> Result<Trace, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        serde_json::from_slice(&bytes).map_err(|e| format!("parsing {}: {e}", path.display()))
    }
}
