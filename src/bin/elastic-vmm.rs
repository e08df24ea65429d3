//! `elastic-vmm`: the command-line tool. Uses the crate's public API only.
//!
//! - `info`: the backend, device, granularity and VMM support.
//! - `demo`: an elastic KV-cache workload (sequences growing block by block and finishing),
//!   with stats as it goes and a summary against a static worst-case preallocation.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use elastic_vmm::backend::{self, cuda::CudaBackend, host::HostBackend};
use elastic_vmm::stats::human_bytes;
use elastic_vmm::{Allocation, Backend, DriverCall, Pool, PoolConfig};

#[derive(Parser)]
#[command(
    name = "elastic-vmm",
    version,
    about = "Elastic GPU memory: reserve once, map on demand, give back"
)]
struct Cli {
    /// Which memory to use: CUDA device 0 when a GPU is found, else host memory.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto, global = true)]
    backend: BackendChoice,
    /// CUDA device ordinal (with --backend cuda or auto).
    #[arg(long, default_value_t = 0, global = true)]
    device: i32,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum BackendChoice {
    Auto,
    Host,
    Cuda,
}

#[derive(Subcommand)]
enum Command {
    /// Print the backend, device, granularity and VMM support.
    Info,
    /// Run an elastic KV-cache workload and compare it with static preallocation.
    Demo(DemoArgs),
}

#[derive(clap::Args, Clone)]
struct DemoArgs {
    /// Sequences to serve in total.
    #[arg(long, default_value_t = 400)]
    sequences: usize,
    /// Sequences running at the same time (the batch).
    #[arg(long, default_value_t = 32)]
    concurrent: usize,
    /// Longest sequence in tokens (prompt plus output): what a static cache reserves per slot.
    #[arg(long, default_value_t = 2048)]
    max_tokens: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_tokens: usize,
    /// KV bytes per token (all layers, K and V).
    #[arg(long, default_value_t = 32 * 1024)]
    bytes_per_token: usize,
    /// Print a line every this many decode steps.
    #[arg(long, default_value_t = 250)]
    report_every: usize,
    /// Seed of the workload generator.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

type BoxError = Box<dyn std::error::Error>;

fn open_backend(
    choice: BackendChoice,
    device: i32,
) -> Result<(Arc<dyn Backend>, Option<String>), BoxError> {
    Ok(match choice {
        BackendChoice::Cuda => (Arc::new(CudaBackend::new(device)?), None),
        BackendChoice::Host => (
            Arc::new(HostBackend::new(backend::host::DEFAULT_GRANULARITY)?),
            None,
        ),
        BackendChoice::Auto if device == 0 => backend::default_backend()?,
        BackendChoice::Auto => match CudaBackend::new(device) {
            Ok(b) => (Arc::new(b), None),
            Err(e) => (
                Arc::new(HostBackend::new(backend::host::DEFAULT_GRANULARITY)?),
                Some(e.to_string()),
            ),
        },
    })
}

fn run(cli: Cli) -> Result<(), BoxError> {
    let (backend, why_not_cuda) = open_backend(cli.backend, cli.device)?;
    if let Some(why) = &why_not_cuda {
        println!("CUDA not used: {why}");
        println!("using host memory (memfd), the embedded default");
    }
    match cli.command {
        Command::Info => info(&backend),
        Command::Demo(args) => demo(backend, &args),
    }
}

fn info(backend: &Arc<dyn Backend>) -> Result<(), BoxError> {
    let i = backend.info();
    let mem = backend.memory_info()?;
    println!("backend            {}", i.name);
    println!("device             {}", i.device_name);
    if let Some(o) = i.device_ordinal {
        println!("device ordinal     {o}");
    }
    println!(
        "granularity        {} (minimum {})",
        human_bytes(i.granularity as u64),
        human_bytes(i.min_granularity as u64)
    );
    println!("VMM supported      {}", i.vmm_supported);
    println!("GPUDirect RDMA     {}", i.rdma_capable);
    println!("POSIX fd export    {}", i.posix_fd_exportable);
    println!(
        "memory             {} free of {}",
        human_bytes(mem.free),
        human_bytes(mem.total)
    );
    Ok(())
}

/// A tiny deterministic generator for the workload.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
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

fn demo(backend: Arc<dyn Backend>, a: &DemoArgs) -> Result<(), BoxError> {
    if a.concurrent == 0 || a.sequences == 0 || a.block_tokens == 0 || a.bytes_per_token == 0 {
        return Err(
            "sequences, concurrent, block-tokens and bytes-per-token must be positive".into(),
        );
    }
    if a.max_tokens < 2 * a.block_tokens {
        return Err(format!(
            "max-tokens {} must be at least two blocks of {} tokens",
            a.max_tokens, a.block_tokens
        )
        .into());
    }
    let block_bytes = a.block_tokens * a.bytes_per_token;
    let blocks_per_seq = a.max_tokens.div_ceil(a.block_tokens);
    let static_bytes = (a.concurrent * blocks_per_seq * block_bytes) as u64;
    // Reserve address space for twice the static worst case: virtual memory is free.
    let capacity = (2 * static_bytes).max(1 << 30);
    let pool = Pool::new(
        backend.clone(),
        PoolConfig::new(capacity as usize).name("demo"),
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
