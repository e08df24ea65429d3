//! `multi`: three models with bursty, out-of-phase load share one device under a global budget
//! smaller than the sum of their peaks. Each model allocates and frees KV blocks to follow its
//! load; memory one model freed and keeps idle is reclaimed by another that needs it. Each
//! model also holds weights; when its load falls quiet it sleeps (KV blocks dropped, weights
//! offloaded to host memory, its whole charge free for the others) and wakes, at the same
//! addresses, when load comes back; the weights are checked after every wake.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use elastic_vmm::shared::SharedStats;
use elastic_vmm::stats::human_bytes;
use elastic_vmm::{
    AfterWake, Allocation, Backend, Error, MemOptions, ModelConfig, SharedPool, SharedPoolConfig,
    SleepAction, SleepPolicy, Tag,
};

use crate::output;
use crate::plot::{self, Series};
use crate::{at_least, mul, to_usize, ArgError, BoxError};

#[derive(clap::Args, Clone)]
pub struct MultiArgs {
    /// Simulation steps.
    #[arg(long, default_value_t = 600)]
    pub steps: usize,
    /// Peak memory of the largest model, in MiB (the others peak at 80% and 60% of it).
    #[arg(long, default_value_t = 512)]
    pub scale_mib: u64,
    /// Global budget as a percentage of the sum of the models' peaks.
    #[arg(long, default_value_t = 50)]
    pub budget_percent: u64,
    /// KV block size in KiB.
    #[arg(long, default_value_t = 2048)]
    pub block_kib: u64,
    /// Steps per load cycle.
    #[arg(long, default_value_t = 200)]
    pub period: usize,
    /// Print a line every this many steps.
    #[arg(long, default_value_t = 40)]
    pub report_every: usize,
    /// A model whose load falls below this percentage of its peak sleeps (KV dropped, weights
    /// offloaded) and wakes when the load rises above it again; 0 keeps every model awake.
    #[arg(long, default_value_t = 12)]
    pub sleep_below: u64,
    /// Share of each model's peak held by its weights, in percent (at most 90).
    #[arg(long, default_value_t = 25)]
    pub weights_percent: u64,
    /// Where to write the SVG plot (missing folders are created).
    #[arg(long, default_value = "multi-model.svg")]
    pub svg: PathBuf,
}

struct Model {
    name: &'static str,
    peak: u64,
    phase: f64,
    handle: elastic_vmm::ModelHandle,
    weights: Option<(Allocation, u8)>,
    blocks: Vec<Allocation>,
    refused: u64,
    asleep: bool,
    sleeps: u64,
    wake_refused: u64,
    series: Series,
}

impl Model {
    /// The weights' first and last pages must hold their byte (after every wake).
    fn check_weights(&self) -> Result<(), BoxError> {
        let Some((w, byte)) = &self.weights else {
            return Ok(());
        };
        let n = w.size().min(4096);
        let mut buf = vec![0u8; n];
        for at in [0, w.size() - n] {
            w.read(at, &mut buf)?;
            if buf.iter().any(|b| b != byte) {
                return Err(
                    format!("{}: weights changed across sleep at byte {at}", self.name).into(),
                );
            }
        }
        Ok(())
    }
}

/// Load in [0, 1]: a quiet base and a burst once per period, shifted by `phase`.
fn load(step: usize, period: usize, phase: f64) -> f64 {
    let x = step as f64 / period as f64 - phase;
    let burst = (2.0 * std::f64::consts::PI * x).sin().max(0.0).powi(2);
    // A little deterministic jitter, so the curves look like traffic.
    let jitter = 0.05 * ((step as f64 * 0.37 + phase * 11.0).sin() * (step as f64 * 0.11).cos());
    (0.08 + 0.92 * burst + jitter).clamp(0.0, 1.0)
}

pub fn run(backend: Arc<dyn Backend>, a: &MultiArgs) -> Result<(), BoxError> {
    at_least("--steps", a.steps as u64, 2)?;
    for (what, v) in [
        ("--period", a.period as u64),
        ("--block-kib", a.block_kib),
        ("--scale-mib", a.scale_mib),
        ("--report-every", a.report_every as u64),
    ] {
        at_least(what, v, 1)?;
    }
    if a.weights_percent > 90 {
        return Err(ArgError::Invalid(format!(
            "--weights-percent {} leaves no room for KV blocks (at most 90)",
            a.weights_percent
        ))
        .into());
    }
    if a.sleep_below > 100 {
        return Err(ArgError::Invalid(format!(
            "--sleep-below {} is a percentage (at most 100)",
            a.sleep_below
        ))
        .into());
    }
    let block = mul("block size (block-kib x 1024)", a.block_kib, 1024)?;
    let largest = mul("largest peak (scale-mib x 1 MiB)", a.scale_mib, 1 << 20)?;
    let peaks = [
        largest,
        mul("second peak", largest, 4)? / 5,
        mul("third peak", largest, 3)? / 5,
    ];
    let sum_of_peaks = peaks
        .iter()
        .try_fold(0u64, |acc, &p| acc.checked_add(p))
        .ok_or_else(|| {
            ArgError::Invalid(format!(
                "the sum of the peaks {} + {} + {} overflows",
                peaks[0], peaks[1], peaks[2]
            ))
        })?;
    let budget = mul("global budget", sum_of_peaks, a.budget_percent)? / 100;
    let shared = SharedPool::new(
        backend.clone(),
        SharedPoolConfig::new().global_limit(budget),
    )?;
    let spec = [
        ("chat", "#1f77b4", 0.0),
        ("code", "#ff7f0e", 1.0 / 3.0),
        ("embed", "#2ca02c", 2.0 / 3.0),
    ];
    let mut models = Vec::new();
    for (i, (name, color, phase)) in spec.into_iter().enumerate() {
        // Each model may use up to its own peak; the budget is what they must share.
        let handle = shared.register(
            ModelConfig::new(
                name,
                to_usize("model capacity", mul("model capacity", 4, peaks[i])?)?,
                peaks[i],
            )
            .priority(i as i32),
        )?;
        models.push(Model {
            name,
            peak: peaks[i],
            phase,
            handle,
            weights: None,
            blocks: Vec::new(),
            refused: 0,
            asleep: false,
            sleeps: 0,
            wake_refused: 0,
            series: Series {
                name: name.to_string(),
                color,
                physical: Vec::new(),
                in_use: Vec::new(),
                asleep: Vec::new(),
            },
        });
    }
    println!(
        "multi-model on {} ({}): peaks {} / {} / {} (sum {}), global budget {} ({}% of the sum), {} blocks",
        backend.info().name,
        backend.info().device_name,
        human_bytes(peaks[0]),
        human_bytes(peaks[1]),
        human_bytes(peaks[2]),
        human_bytes(sum_of_peaks),
        human_bytes(budget),
        a.budget_percent,
        human_bytes(block)
    );
    println!(
        "{:>5}  {:>21}  {:>21}  {:>21}  {:>10}",
        "step", "chat in use/held", "code in use/held", "embed in use/held", "budget use"
    );
    let block_len = to_usize("block size", block)?;
    // Weights: loaded once, tagged, checked after every wake.
    for (i, m) in models.iter_mut().enumerate() {
        let bytes = mul("weights", m.peak, a.weights_percent)? / 100;
        if bytes > 0 {
            let mut w = m.handle.allocate_with(
                to_usize("weights", bytes)?,
                &MemOptions::new().tag(Tag::Weights),
            )?;
            let byte = 0x41 + i as u8;
            w.fill(byte)?;
            m.weights = Some((w, byte));
        }
    }
    let policy = SleepPolicy::offload_all().tag(Tag::Kv, SleepAction::Discard);
    let threshold = a.sleep_below as f64 / 100.0;
    let started = Instant::now();
    let mut peak_global = 0;
    for step in 0..a.steps {
        for m in &mut models {
            let l = load(step, a.period, m.phase);
            if l < threshold && !m.asleep {
                // Quiet: the engine drops its KV cache and the model sleeps.
                m.blocks.clear();
                m.handle.sleep(&policy)?;
                m.asleep = true;
                m.sleeps += 1;
            } else if l >= threshold && m.asleep {
                match m.handle.wake(AfterWake::KeepHostMemory) {
                    Ok(_) => {
                        m.asleep = false;
                        m.check_weights()?;
                    }
                    // No room yet: it stays asleep and tries again next step.
                    Err(Error::WakeRefused { .. }) => m.wake_refused += 1,
                    Err(e) => return Err(e.into()),
                }
            }
            if m.asleep {
                continue;
            }
            let weights = m.weights.as_ref().map_or(0, |(w, _)| w.footprint());
            let kv_peak = m.peak.saturating_sub(weights);
            let target = ((l * kv_peak as f64) as u64 / block) as usize;
            while m.blocks.len() > target {
                m.blocks.pop();
            }
            while m.blocks.len() < target {
                match m
                    .handle
                    .allocate_with(block_len, &MemOptions::new().tag(Tag::Kv))
                {
                    Ok(b) => m.blocks.push(b),
                    Err(Error::AdmissionRefused { .. }) => {
                        // The request waits for memory: it is retried next step.
                        m.refused += 1;
                        break;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        let st = shared.stats();
        peak_global = peak_global.max(st.global.used);
        for m in &mut models {
            let ms = st
                .models
                .iter()
                .find(|x| x.id == m.name)
                .ok_or("model missing from stats")?;
            m.series.physical.push(ms.used);
            // Asleep, nothing is in use on the device (the books keep the allocations).
            m.series.in_use.push(if m.asleep { 0 } else { ms.in_use });
            m.series.asleep.push(m.asleep);
        }
        if step % a.report_every == 0 || step + 1 == a.steps {
            print_row(step, &st);
        }
        if let Err(e) = shared.audit() {
            return Err(format!("accounting broke at step {step}: {e}").into());
        }
    }
    let st = shared.stats();
    println!();
    println!("summary ({} steps in {:.2?})", a.steps, started.elapsed());
    for m in &models {
        let ms = st
            .models
            .iter()
            .find(|x| x.id == m.name)
            .ok_or("model missing from stats")?;
        let ss = m.handle.sleep_stats();
        let ms_of = |d: Option<std::time::Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1e3);
        println!(
            "  {:<6} slept {} times (last sleep {:.2} ms, last wake {:.2} ms), {} wakes waited for room, host staging {}",
            m.name,
            m.sleeps,
            ms_of(ss.last_sleep),
            ms_of(ss.last_wake),
            m.wake_refused,
            human_bytes(ss.host_bytes)
        );
        println!(
            "  {:<6} peak in use {:>10}, peak held {:>10}, limit {:>10}; {} block requests waited for memory; {} reclaimed from it for others",
            m.name,
            human_bytes(ms.peak_in_use),
            human_bytes(ms.peak),
            human_bytes(ms.limit),
            m.refused,
            human_bytes(ms.reclaimed)
        );
    }
    println!(
        "  global: peak {} of the {} budget; a static partition at each model's peak would need {} ({:.0}% more)",
        human_bytes(peak_global),
        human_bytes(budget),
        human_bytes(sum_of_peaks),
        100.0 * (sum_of_peaks as f64 / budget as f64 - 1.0)
    );
    let series: Vec<Series> = models.into_iter().map(|m| m.series).collect();
    let svg = plot::render(
        &format!(
            "Three models sharing {} of {} ({})",
            human_bytes(budget),
            backend.info().device_name,
            backend.info().name
        ),
        &series,
        budget,
        sum_of_peaks,
    );
    output::write_file(&a.svg, svg.as_bytes())?;
    println!("  plot written to {}", a.svg.display());
    Ok(())
}

fn print_row(step: usize, st: &SharedStats) {
    let cell = |id: &str| {
        st.models
            .iter()
            .find(|m| m.id == id)
            .map_or_else(String::new, |m| {
                if m.asleep > 0 && m.used == 0 {
                    format!("asleep ({})", human_bytes(m.asleep))
                } else {
                    format!("{} / {}", human_bytes(m.in_use), human_bytes(m.used))
                }
            })
    };
    println!(
        "{:>5}  {:>21}  {:>21}  {:>21}  {:>9.0}%",
        step,
        cell("chat"),
        cell("code"),
        cell("embed"),
        100.0 * st.global.used as f64 / st.global.limit as f64
    );
}
