//! The measurement core: one record per request of a run, whatever became of it, and the
//! statistics read from them.
//!
//! - Every request of the trace has a [`Record`]: finished, censored (unfinished when the run
//!   ended) or refused (it could never fit). A run's statistics count all of them.
//! - Censoring: a request unfinished at the run's end has its TTFT (if it had no first token)
//!   and its TPOT censored at the run's end: the value it would have if its next token came at
//!   the end, a lower bound of the true one. Refused requests are censored the same way. So a
//!   tail of requests that never got served raises the percentiles instead of vanishing from
//!   them.
//! - The SLO: a request meets it when it finished, its TTFT is at most `ttft_s` and its mean
//!   TPOT at most `tpot_s`. Censored and refused requests never meet it.
//! - Goodput: requests meeting the SLO per second of the trace.
//! - Over seeds (or trace windows): the mean and a 95% confidence interval (Student t).
//! - The knee: the load at which the best static policy's SLO attainment falls below 99%.

use serde::{Deserialize, Serialize};

/// What became of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Every output token generated before the run ended.
    Finished,
    /// Still queued or running when the run ended.
    Censored,
    /// Refused at admission: it could never fit the model's memory or context.
    Refused,
}

/// One request of a run. Times are seconds from the run's start instant (wall clock).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// The model it was for.
    pub model: usize,
    /// Its index in its model's trace.
    pub id: u64,
    /// Arrival time.
    pub arrival: f64,
    /// Time of its first token (`None`: none before the end).
    pub first_token: Option<f64>,
    /// Time of its last token (`None`: not finished).
    pub finish: Option<f64>,
    /// Prompt tokens.
    pub prompt: u32,
    /// Output tokens it asked for.
    pub output: u32,
    /// Output tokens it got.
    pub generated: u32,
    /// What became of it.
    pub outcome: Outcome,
    /// Times it was preempted.
    pub preemptions: u32,
}

impl Record {
    /// Time to first token; censored at `end` when it has none (a lower bound then).
    pub fn ttft(&self, end: f64) -> f64 {
        (self.first_token.unwrap_or(end) - self.arrival).max(0.0)
    }

    /// Mean time per output token after the first: over its decode for a finished request;
    /// for a censored one with a first token, as if its remaining tokens all came at `end` (a
    /// lower bound); `None` for a request with no first token (no TPOT can be bounded) or a
    /// single-token request.
    pub fn tpot(&self, end: f64) -> Option<f64> {
        let first = self.first_token?;
        if self.output <= 1 {
            return None;
        }
        let last = match self.outcome {
            Outcome::Finished => self.finish.unwrap_or(end),
            _ => end,
        };
        Some((last - first).max(0.0) / (self.output - 1) as f64)
    }

    /// Whether it met `slo`.
    pub fn meets(&self, slo: &Slo, end: f64) -> bool {
        self.outcome == Outcome::Finished
            && self.ttft(end) <= slo.ttft_s
            && self.tpot(end).is_none_or(|t| t <= slo.tpot_s)
    }
}

/// A service-level objective.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Most seconds to the first token.
    pub ttft_s: f64,
    /// Most mean seconds per output token after the first.
    pub tpot_s: f64,
}

/// The `p` quantile (0..=1) of `v` by nearest rank (the smallest value with at least `p` of
/// the values at or below it); NaN for no values.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = (p * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

/// One run's statistics over all its requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunStats {
    /// Requests in the trace.
    pub requests: u64,
    /// Finished.
    pub finished: u64,
    /// Censored at the run's end.
    pub censored: u64,
    /// Refused.
    pub refused: u64,
    /// Preemptions over all requests.
    pub preemptions: u64,
    /// Fraction of requests meeting the SLO (1 for a run with no requests).
    pub slo_attainment: f64,
    /// Requests meeting the SLO per second of the trace.
    pub goodput: f64,
    /// Output tokens generated per second of the run.
    pub throughput: f64,
    /// TTFT percentiles over all requests (censored ones at their lower bound).
    pub ttft_p50: f64,
    /// 90th.
    pub ttft_p90: f64,
    /// 99th.
    pub ttft_p99: f64,
    /// TPOT percentiles over all requests with a first token (censored at a lower bound).
    pub tpot_p50: f64,
    /// 90th.
    pub tpot_p90: f64,
    /// 99th.
    pub tpot_p99: f64,
}

impl RunStats {
    /// The statistics of `records`, a run of a `trace_s`-second trace that ended at `end`.
    pub fn of(records: &[Record], slo: &Slo, trace_s: f64, end: f64) -> RunStats {
        let count = |o: Outcome| records.iter().filter(|r| r.outcome == o).count() as u64;
        let ttft: Vec<f64> = records.iter().map(|r| r.ttft(end)).collect();
        let tpot: Vec<f64> = records.iter().filter_map(|r| r.tpot(end)).collect();
        let met = records.iter().filter(|r| r.meets(slo, end)).count();
        let n = records.len();
        RunStats {
            requests: n as u64,
            finished: count(Outcome::Finished),
            censored: count(Outcome::Censored),
            refused: count(Outcome::Refused),
            preemptions: records.iter().map(|r| r.preemptions as u64).sum(),
            slo_attainment: if n == 0 { 1.0 } else { met as f64 / n as f64 },
            goodput: met as f64 / trace_s.max(1e-9),
            throughput: records.iter().map(|r| r.generated as f64).sum::<f64>() / end.max(1e-9),
            ttft_p50: percentile(&ttft, 0.5),
            ttft_p90: percentile(&ttft, 0.9),
            ttft_p99: percentile(&ttft, 0.99),
            tpot_p50: percentile(&tpot, 0.5),
            tpot_p90: percentile(&tpot, 0.9),
            tpot_p99: percentile(&tpot, 0.99),
        }
    }

    /// The metrics by name, in table order (`unserved`: censored and refused requests).
    pub fn metrics(&self) -> [(&'static str, f64); 9] {
        [
            ("slo", self.slo_attainment),
            ("goodput", self.goodput),
            ("tok/s", self.throughput),
            ("ttft p50", self.ttft_p50),
            ("ttft p90", self.ttft_p90),
            ("ttft p99", self.ttft_p99),
            ("tpot p50", self.tpot_p50),
            ("tpot p99", self.tpot_p99),
            ("unserved", self.censored as f64 + self.refused as f64),
        ]
    }
}

/// The 0.975 quantile of Student's t with `df` degrees of freedom (two-sided 95%).
pub fn t975(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::INFINITY,
        1..=30 => T[df - 1],
        31..=40 => 2.021,
        41..=60 => 2.000,
        61..=120 => 1.980,
        _ => 1.960,
    }
}

/// Mean and half-width of the 95% confidence interval of `v` (Student t; the half-width is
/// infinite for one sample, NaN values are left out). `(NaN, NaN)` for none.
pub fn mean_ci(v: &[f64]) -> (f64, f64) {
    let v: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    let n = v.len();
    if n == 0 {
        return (f64::NAN, f64::NAN);
    }
    let mean = v.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return (mean, f64::INFINITY);
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, t975(n - 1) * (var / n as f64).sqrt())
}

/// The knee: given the best static policy's mean SLO attainment at each load (any order), the
/// load at which it falls below `target` (0.99), interpolated linearly between the last load
/// that meets it and the first that does not. `None` when it never falls below; the lowest
/// load when it misses already there.
pub fn knee(points: &[(f64, f64)], target: f64) -> Option<f64> {
    let mut p = points.to_vec();
    p.sort_by(|a, b| a.0.total_cmp(&b.0));
    let i = p.iter().position(|&(_, a)| a < target)?;
    if i == 0 {
        return Some(p[0].0);
    }
    let ((l0, a0), (l1, a1)) = (p[i - 1], p[i]);
    Some(l0 + (l1 - l0) * (a0 - target) / (a0 - a1))
}

/// Least squares `y ~ X b` for a few columns (`rows` are X's rows): the normal equations,
/// solved by Gaussian elimination. An error when they are singular (a column with no
/// variation of its own). `serve probe` fits its cost model with it.
#[cfg_attr(not(feature = "candle-example"), allow(dead_code))]
pub fn least_squares(rows: &[Vec<f64>], y: &[f64]) -> Result<Vec<f64>, String> {
    let n = rows.first().map_or(0, Vec::len);
    if n == 0 || rows.len() != y.len() || rows.iter().any(|r| r.len() != n) {
        return Err(format!(
            "least squares: {} rows of {n} columns against {} values",
            rows.len(),
            y.len()
        ));
    }
    let mut m = vec![vec![0.0; n + 1]; n];
    for (r, yi) in rows.iter().zip(y) {
        for (row, ri) in m.iter_mut().zip(r) {
            for (x, rj) in row.iter_mut().zip(r) {
                *x += ri * rj;
            }
            row[n] += ri * yi;
        }
    }
    for c in 0..n {
        let p = (c..n)
            .max_by(|&a, &b| m[a][c].abs().total_cmp(&m[b][c].abs()))
            .unwrap_or(c);
        m.swap(c, p);
        let scale = m.iter().map(|r| r[c].abs()).fold(0.0, f64::max);
        if m[c][c].abs() <= 1e-12 * scale.max(f64::MIN_POSITIVE) {
            return Err(format!("least squares: singular at column {c}"));
        }
        let pivot = m[c].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != c {
                let k = row[c] / pivot[c];
                for (x, p) in row.iter_mut().zip(&pivot).skip(c) {
                    *x -= k * p;
                }
            }
        }
    }
    Ok((0..n).map(|i| m[i][n] / m[i][i]).collect())
}
