//! What each model serves in a run: a window of a real production trace, time-scaled to the
//! load point, or the seeded generator's trace (`trace.rs`) for sweeps.
//!
//! Real traces (`../shared/traces` beside the repository, or `--traces-dir`; see its README
//! for the licenses and citations, which go with any copy):
//! - Azure LLM inference trace 2023, conversation and code (`azure-llm-2023-{conv,code}.csv`:
//!   `TIMESTAMP,ContextTokens,GeneratedTokens`). CC-BY 4.0; Patel et al., "Splitwise:
//!   Efficient generative LLM inference using phase splitting", ISCA 2024.
//! - Mooncake conversation trace (`mooncake-conversation.jsonl`: `timestamp` in ms,
//!   `input_length`, `output_length`). Apache-2.0; Qin et al., "Mooncake: A KVCache-centric
//!   Architecture for Serving LLM Chatbot", FAST 2025.
//!
//! Model `m` replays source `m mod n` of the sources named. Its window: at a target rate `r`
//! requests/s for a `d`-second run, `r d` consecutive requests of the trace, starting at one
//! drawn from the seed and the model (so seeds are windows), time-scaled so that they span the
//! run. Every window offers the load asked; its bursts and lulls are the trace's own, only
//! faster or slower. (Scaling by the whole trace's mean rate instead let windows offer 8x more
//! or less than the load point: on the H200, one seed's windows brought 83 requests at a load
//! whose other seeds brought 9 and 10.) Lengths are multiplied by
//! `len_scale` (the host simulation serves smaller contexts), then cut to the engines' context
//! ([`Lengths`]: the output to half of it, the prompt to the rest).

use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::trace::{Request, Trace, TraceConfig};

/// One request of a trace file: seconds from the trace's first request, prompt and output
/// tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Row {
    /// Seconds from the first request.
    pub t: f64,
    /// Prompt tokens.
    pub prompt: u32,
    /// Output tokens.
    pub output: u32,
}

/// Where a model's requests come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The seeded generator (kvcached-like ramps and flash crowds).
    Synthetic,
    /// Azure 2023 conversation.
    AzureConv,
    /// Azure 2023 code.
    AzureCode,
    /// Mooncake conversation.
    Mooncake,
}

impl Source {
    /// Parse `synthetic`, `conv`, `code` or `mooncake`.
    pub fn parse(s: &str) -> Result<Source, String> {
        Ok(match s {
            "synthetic" => Source::Synthetic,
            "conv" => Source::AzureConv,
            "code" => Source::AzureCode,
            "mooncake" => Source::Mooncake,
            _ => {
                return Err(format!(
                    "unknown trace {s:?}: synthetic, conv, code or mooncake"
                ))
            }
        })
    }

    /// Its name.
    pub fn name(&self) -> &'static str {
        match self {
            Source::Synthetic => "synthetic",
            Source::AzureConv => "conv",
            Source::AzureCode => "code",
            Source::Mooncake => "mooncake",
        }
    }

    /// Its file in the traces folder.
    pub fn file(&self) -> Option<&'static str> {
        match self {
            Source::Synthetic => None,
            Source::AzureConv => Some("azure-llm-2023-conv.csv"),
            Source::AzureCode => Some("azure-llm-2023-code.csv"),
            Source::Mooncake => Some("mooncake-conversation.jsonl"),
        }
    }
}

/// Seconds since the start of the month of an Azure timestamp `YYYY-MM-DD HH:MM:SS[.fffffff]`.
fn azure_time(s: &str) -> Option<f64> {
    let (date, time) = s.trim().split_once(' ')?;
    let day: f64 = date.split('-').nth(2)?.parse().ok()?;
    let mut hms = time.split(':');
    let h: f64 = hms.next()?.parse().ok()?;
    let m: f64 = hms.next()?.parse().ok()?;
    let sec: f64 = hms.next()?.parse().ok()?;
    Some(((day * 24.0 + h) * 60.0 + m) * 60.0 + sec)
}

fn rebase(mut rows: Vec<Row>) -> Vec<Row> {
    rows.sort_by(|a, b| a.t.total_cmp(&b.t));
    let t0 = rows.first().map_or(0.0, |r| r.t);
    for r in &mut rows {
        r.t -= t0;
    }
    rows
}

/// Parse an Azure LLM trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).
pub fn parse_azure(text: &str) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || (i == 0 && line.starts_with("TIMESTAMP")) {
            continue;
        }
        let bad = || {
            format!(
                "line {}: not TIMESTAMP,ContextTokens,GeneratedTokens: {line:?}",
                i + 1
            )
        };
        let mut f = line.split(',');
        let t = f.next().and_then(azure_time).ok_or_else(bad)?;
        let prompt = f
            .next()
            .and_then(|x| x.trim().parse().ok())
            .ok_or_else(bad)?;
        let output = f
            .next()
            .and_then(|x| x.trim().parse().ok())
            .ok_or_else(bad)?;
        rows.push(Row { t, prompt, output });
    }
    Ok(rebase(rows))
}

/// Parse the Mooncake trace (JSON lines with `timestamp` in ms, `input_length`,
/// `output_length`).
pub fn parse_mooncake(text: &str) -> Result<Vec<Row>, String> {
    #[derive(serde::Deserialize)]
    struct Line {
        timestamp: f64,
        input_length: u32,
        output_length: u32,
    }
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let l: Line =
            serde_json::from_str(line).map_err(|e| format!("line {}: {e}: {line:?}", i + 1))?;
        rows.push(Row {
            t: l.timestamp / 1e3,
            prompt: l.input_length,
            output: l.output_length,
        });
    }
    Ok(rebase(rows))
}

/// Load `source`'s file from `dir`.
pub fn load(dir: &Path, source: Source) -> Result<Vec<Row>, String> {
    let Some(file) = source.file() else {
        return Err("the synthetic source has no file".into());
    };
    let path = dir.join(file);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let rows = match source {
        Source::Mooncake => parse_mooncake(&text),
        _ => parse_azure(&text),
    }
    .map_err(|e| format!("{}: {e}", path.display()))?;
    if rows.len() < 2 {
        return Err(format!("{}: fewer than two requests", path.display()));
    }
    Ok(rows)
}

/// The trace's span (seconds) and mean rate (requests/s).
pub fn span_rate(rows: &[Row]) -> (f64, f64) {
    let span = rows.last().map_or(0.0, |r| r.t).max(1e-9);
    (span, rows.len() as f64 / span)
}

/// How lengths are scaled.
#[derive(Debug, Clone, Copy)]
pub struct Lengths {
    /// Factor on prompt and output lengths.
    pub scale: f64,
    /// Longest context (prompt and output) after scaling: the engines' context. The output is
    /// cut to half of it, then the prompt to the rest (as a front end truncates a prompt to
    /// the model's context), so no request is refused for its length alone.
    pub max_len: u32,
}

impl Lengths {
    fn scaled(&self, n: u32) -> u32 {
        (n as f64 * self.scale).round().max(1.0) as u32
    }

    /// Prompt and output of a request of `prompt` and `output` tokens.
    pub fn apply(&self, prompt: u32, output: u32) -> (u32, u32) {
        let max = self.max_len.max(2);
        let output = self.scaled(output).min(max / 2);
        (self.scaled(prompt).min(max - output), output)
    }
}

/// Model `model`'s requests: a window of `rows` replayed at `rate` requests/s for
/// `duration_s` seconds. The window is `rate * duration_s` consecutive requests (at least one),
/// its first drawn from `seed` and `model`; it is time-scaled so that those requests span the
/// run (the window's own mean rate becomes `rate`), keeping its bursts and lulls in proportion.
/// So every seed offers the load asked, and seeds differ in the traffic's shape and lengths;
/// a trace with fewer than `rate * duration_s` requests gives them all (the caller checks).
/// Arrivals are seconds from the run's start; ids count from 0 in arrival order.
pub fn window(
    rows: &[Row],
    model: usize,
    seed: u64,
    rate: f64,
    duration_s: f64,
    len: Lengths,
) -> Vec<Request> {
    if rows.is_empty() || !(rate > 0.0 && duration_s > 0.0) {
        return Vec::new();
    }
    let n = ((rate * duration_s).round() as usize).clamp(1, rows.len());
    let mut rng =
        StdRng::seed_from_u64(seed ^ (model as u64 + 1).wrapping_mul(0x2545_F491_4F6C_DD1D));
    let first = rng.random_range(0..=rows.len() - n);
    let start = rows[first].t;
    // The window's span: to the next request after it (n arrivals in it), or, at the trace's
    // end, its last gap's worth past its last request.
    let span = match rows.get(first + n) {
        Some(next) => next.t - start,
        None if n > 1 => (rows[first + n - 1].t - start) * n as f64 / (n - 1) as f64,
        None => 0.0,
    };
    // Arrivals strictly inside the run; a window with no span (every request at one
    // instant) is spread evenly over it.
    let last_us = ((duration_s * 1e6) as u64).saturating_sub(1);
    rows[first..first + n]
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (prompt, output) = len.apply(r.prompt, r.output);
            let at = if span > 0.0 {
                (r.t - start) * duration_s / span
            } else {
                i as f64 * duration_s / n as f64
            };
            Request {
                id: i as u64,
                model,
                arrival_us: ((at * 1e6) as u64).min(last_us),
                prompt,
                output,
            }
        })
        .collect()
}

/// Prism-like idle periods: of model `model`'s `reqs`, those arriving in its bursts (`on`
/// seconds, then `off` idle, the `models` models' bursts spread evenly over the cycle), ids
/// counted again from 0.
pub fn bursts(reqs: Vec<Request>, model: usize, models: usize, on: f64, off: f64) -> Vec<Request> {
    let cycle = on + off;
    let offset = cycle * model as f64 / models.max(1) as f64;
    reqs.into_iter()
        .filter(|r| (r.arrival() - offset).rem_euclid(cycle) < on)
        .enumerate()
        .map(|(i, r)| Request { id: i as u64, ..r })
        .collect()
}

/// Every model's requests from the seeded generator at a mean `rate` requests/s per model
/// (its peak chosen so; kvcached-like ramps, out of phase, and flash crowds).
pub fn synthetic(
    models: usize,
    seed: u64,
    rate: f64,
    duration_s: f64,
    len: Lengths,
) -> Result<Vec<Vec<Request>>, String> {
    let unit = TraceConfig::kvcached_like(seed, models, 1.0, duration_s);
    let per_peak = (0..models).map(|m| unit.expected_rate(m)).sum::<f64>() / models as f64;
    let mut c = TraceConfig::kvcached_like(seed, models, rate / per_peak, duration_s);
    c.max_len = len.max_len;
    let t = Trace::generate(&c)?;
    let mut out = vec![Vec::new(); models];
    for r in t.requests {
        let q = &mut out[r.model];
        let (prompt, output) = len.apply(r.prompt, r.output);
        q.push(Request {
            id: q.len() as u64,
            prompt,
            output,
            ..r
        });
    }
    Ok(out)
}

/// The mean KV demand of one request of `reqs` in token-steps: its context held over its
/// decode, about `(prompt + output / 2) * output` (0 for none). A model's mean demand is this
/// times its arrival rate (Little's law, in units of a decode step).
pub fn demand_per_request(reqs: &[Request]) -> f64 {
    if reqs.is_empty() {
        return 0.0;
    }
    reqs.iter()
        .map(|r| (r.prompt as f64 + r.output as f64 / 2.0) * r.output as f64)
        .sum::<f64>()
        / reqs.len() as f64
}

/// The mean prompt and output lengths of `reqs` (0 for none).
pub fn mean_lengths(reqs: &[Request]) -> (f64, f64) {
    if reqs.is_empty() {
        return (0.0, 0.0);
    }
    let n = reqs.len() as f64;
    (
        reqs.iter().map(|r| r.prompt as f64).sum::<f64>() / n,
        reqs.iter().map(|r| r.output as f64).sum::<f64>() / n,
    )
}

/// The mean context of a request of `reqs` over its decode, `prompt + output / 2` (0 for
/// none).
pub fn mean_context(reqs: &[Request]) -> f64 {
    if reqs.is_empty() {
        return 0.0;
    }
    reqs.iter()
        .map(|r| r.prompt as f64 + r.output as f64 / 2.0)
        .sum::<f64>()
        / reqs.len() as f64
}
