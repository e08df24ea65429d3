//! `demo`: sequences whose KV caches grow block by block and finish, memory reused.

use std::sync::Arc;
use std::time::{Duration, Instant};

use elastic_vmm::stats::human_bytes;
use elastic_vmm::{Allocation, Backend, DriverCall, Pool, PoolConfig};

use crate::{at_least, mul, to_usize, ArgError, BoxError, DemoArgs};

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
}

struct Sequence {
    tokens: usize,
    target: usize,
    blocks: Vec<Allocation>,
}

#[derive(Default)]
struct Timing {
    total: Duration,
    count: u64,
    max: Duration,
}

impl Timing {
    fn add(&mut self, d: Duration) {
        self.total += d;
        self.count += 1;
        self.max = self.max.max(d);
    }
    fn mean_ns(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.total.as_nanos() as f64 / self.count as f64
        }
    }
}

pub fn run(backend: Arc<dyn Backend>, a: &DemoArgs) -> Result<(), BoxError> {
    for (what, v) in [
        ("--sequences", a.sequences),
        ("--concurrent", a.concurrent),
        ("--block-tokens", a.block_tokens),
        ("--bytes-per-token", a.bytes_per_token),
        ("--report-every", a.report_every),
    ] {
        at_least(what, v as u64, 1)?;
    }
    if a.max_tokens / 2 < a.block_tokens {
        return Err(ArgError::Invalid(format!(
            "--max-tokens must be at least two blocks of --block-tokens {}, got {}",
            a.block_tokens, a.max_tokens
        ))
        .into());
    }
    let block_bytes = mul(
        "block bytes (block-tokens x bytes-per-token)",
        a.block_tokens as u64,
        a.bytes_per_token as u64,
    )?;
    let blocks_per_seq = a.max_tokens.div_ceil(a.block_tokens) as u64;
    let static_bytes = mul(
        "static worst case (concurrent x blocks per sequence x block bytes)",
        mul(
            "blocks in the static cache",
            a.concurrent as u64,
            blocks_per_seq,
        )?,
        block_bytes,
    )?;
    // Reserve address space for twice the static worst case: virtual memory is free.
    let capacity = mul("address space to reserve", 2, static_bytes)?.max(1 << 30);
    let block_bytes = to_usize("block bytes", block_bytes)?;
    let pool = Pool::new(
        backend.clone(),
        PoolConfig::new(to_usize("address space to reserve", capacity)?).name("demo"),
    )?;
    let info = backend.info();
    println!(
        "demo on {} ({}): {} sequences, {} at a time, up to {} tokens each, {} per {}-token block",
        info.name,
        info.device_name,
        a.sequences,
        a.concurrent,
        a.max_tokens,
        human_bytes(block_bytes as u64),
        a.block_tokens
    );
    println!(
        "static worst case: {} slots x {} blocks = {}; reserved {} of address space, nothing physical yet",
        a.concurrent,
        blocks_per_seq,
        human_bytes(static_bytes),
        human_bytes(pool.capacity())
    );
    println!(
        "{:>6} {:>7} {:>10} {:>10} {:>10} {:>10} {:>12}",
        "step", "active", "in use", "mapped", "cached", "physical", "driver calls"
    );

    let mut rng = Rng(a.seed.max(1));
    let mut started = 0usize;
    let mut finished = 0usize;
    let mut active: Vec<Sequence> = Vec::new();
    let mut alloc_t = Timing::default();
    let mut free_t = Timing::default();
    let mut step = 0usize;
    let mut tokens_generated = 0u64;
    let wall = Instant::now();
    while finished < a.sequences {
        // Admit new sequences (bursty: a few at a time) up to the batch size.
        let burst = rng.range(1, 4);
        for _ in 0..burst {
            if active.len() >= a.concurrent || started >= a.sequences {
                break;
            }
            let prompt = rng.range(a.block_tokens, a.max_tokens / 2);
            let output = rng.range(a.block_tokens, a.max_tokens - prompt);
            let mut seq = Sequence {
                tokens: 0,
                target: prompt + output,
                blocks: Vec::new(),
            };
            // Prefill: blocks for the whole prompt at once.
            for _ in 0..prompt.div_ceil(a.block_tokens) {
                let t = Instant::now();
                let block = pool.allocate(block_bytes)?;
                alloc_t.add(t.elapsed());
                seq.blocks.push(block);
            }
            seq.tokens = prompt;
            active.push(seq);
            started += 1;
        }
        // Decode: one token per active sequence; a new block when one fills.
        for seq in &mut active {
            if seq.tokens % a.block_tokens == 0 {
                let t = Instant::now();
                let block = pool.allocate(block_bytes)?;
                alloc_t.add(t.elapsed());
                seq.blocks.push(block);
            }
            seq.tokens += 1;
            tokens_generated += 1;
        }
        // Finished sequences give their blocks back.
        let mut i = 0;
        while i < active.len() {
            if active[i].tokens >= active[i].target {
                let seq = active.swap_remove(i);
                for block in seq.blocks {
                    let t = Instant::now();
                    drop(block);
                    free_t.add(t.elapsed());
                }
                finished += 1;
            } else {
                i += 1;
            }
        }
        step += 1;
        if step % a.report_every == 0 || finished == a.sequences {
            let s = pool.stats();
            println!(
                "{:>6} {:>7} {:>10} {:>10} {:>10} {:>10} {:>12}",
                step,
                active.len(),
                human_bytes(s.in_use),
                human_bytes(s.mapped),
                human_bytes(s.cached),
                human_bytes(s.physical()),
                s.driver_calls.total()
            );
        }
    }
    let elapsed = wall.elapsed();
    let s = pool.stats();
    let trim_t = Instant::now();
    let trimmed = pool.trim()?;
    let trim_elapsed = trim_t.elapsed();
    let after = pool.stats();
    println!();
    println!("summary");
    println!(
        "  sequences served        {} ({} tokens decoded in {} steps, {:.2?})",
        finished, tokens_generated, step, elapsed
    );
    println!(
        "  peak physical           {} (peak in use {}) vs static worst case {}: {:.1}% of it, {} never taken",
        human_bytes(s.peak_physical),
        human_bytes(s.peak_in_use),
        human_bytes(static_bytes),
        100.0 * s.peak_physical as f64 / static_bytes as f64,
        human_bytes(static_bytes.saturating_sub(s.peak_physical))
    );
    println!(
        "  allocations             {} allocate, mean {:.0} ns, max {:.1?}; {} free, mean {:.0} ns, max {:.1?}",
        alloc_t.count,
        alloc_t.mean_ns(),
        alloc_t.max,
        free_t.count,
        free_t.mean_ns(),
        free_t.max
    );
    let dc = s.driver_calls;
    println!(
        "  driver calls            {} in total for {} allocations ({}); {} map calls backed {} physical chunks",
        dc.total(),
        s.allocations,
        dc,
        dc.get(DriverCall::Map),
        s.mapped_chunks
    );
    println!(
        "  give back               trim unmapped {} and released {} in {:.2?}; now mapped {}, cached {}",
        human_bytes(trimmed.unmapped),
        human_bytes(trimmed.released),
        trim_elapsed,
        human_bytes(after.mapped),
        human_bytes(after.cached)
    );
    if after.physical() != 0 || after.in_use != 0 {
        return Err(format!("memory left after the workload: {after}").into());
    }
    Ok(())
}
