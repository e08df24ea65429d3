//! A real transformer whose every allocation is elastic memory under its model's limit.
//!
//! candle-transformers' Llama with a small config (~220 M parameters, ~440 MB in bf16) and
//! random weights this program writes to safetensors files (nothing is downloaded), loaded with
//! candle's own loader inside a route. Two such models generate tokens in one process under one
//! budget smaller than the sum of their limits; memory per model and tag is printed as they go,
//! and every step's logits must equal (bit for bit) those of an unrouted run of the same model.
//!
//! ```text
//! routed_llama [--steps N] [--dir FOLDER]     two models, routed, checked against unrouted
//! routed_llama --bench [--steps N] [--rounds R]  decode step: routed against candle's default
//! routed_llama --switch [--steps N] [--rounds R] two models that do not fit together take
//!                                                turns: sleep one, wake the other, generate
//! ```
//! Needs a CUDA GPU. Exit status 0 only when every check passed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::llama::{Cache, Config, Llama, LlamaConfig};
use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::route::{self, RouteStats};
use elastic_vmm::{
    AfterWake, ModelConfig, ModelHandle, SharedPool, SharedPoolConfig, SleepPolicy, Tag,
};

elastic_vmm::route_cuda_allocations!();

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn config() -> Config {
    LlamaConfig {
        hidden_size: 1024,
        intermediate_size: 2816,
        vocab_size: 32000,
        num_hidden_layers: 12,
        num_attention_heads: 16,
        num_key_value_heads: Some(4),
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        bos_token_id: Some(1),
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: 1024,
        tie_word_embeddings: Some(false),
    }
    .into_config(false)
}

const DTYPE: DType = DType::BF16;
const PROMPT: [u32; 12] = [
    1, 415, 2936, 9060, 285, 1142, 10575, 754, 272, 17898, 3914, 28723,
];

/// Random weights for `cfg`, written once per name (candle initialises every variable the
/// model asks for with fresh random values; the file holds exactly what `Llama::load` reads).
fn write_weights(dir: &Path, name: &str, cfg: &Config) -> Res<PathBuf> {
    let path = dir.join(format!("llama-random-{name}.safetensors"));
    if path.exists() {
        return Ok(path);
    }
    let cpu = Device::Cpu;
    let map = VarMap::new();
    {
        let vb = VarBuilder::from_varmap(&map, DTYPE, &cpu);
        let _ = Llama::load(vb, cfg)?;
    }
    map.save(&path)?;
    Ok(path)
}

/// One generation in progress.
struct Session {
    model: Llama,
    cache: Cache,
    tokens: Vec<u32>,
    pos: usize,
    device: Device,
}

impl Session {
    fn new(weights: &Path, cfg: &Config, device: &Device) -> Res<Session> {
        // SAFETY: the file is ours and not modified while mapped.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[weights], DTYPE, device)? };
        let model = Llama::load(vb, cfg)?;
        let cache = Cache::new(true, DTYPE, cfg, device)?;
        Ok(Session {
            model,
            cache,
            tokens: PROMPT.to_vec(),
            pos: 0,
            device: device.clone(),
        })
    }

    /// One decode step (the first one takes the prompt): the logits, and the greedy token
    /// appended.
    fn step(&mut self) -> Res<Vec<f32>> {
        let ctx = if self.pos == 0 {
            &self.tokens[..]
        } else {
            &self.tokens[self.tokens.len() - 1..]
        };
        let input = Tensor::new(ctx, &self.device)?.unsqueeze(0)?;
        let logits = self.model.forward(&input, self.pos, &mut self.cache)?;
        self.pos += ctx.len();
        let logits = logits.squeeze(0)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let next = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap_or(0);
        self.tokens.push(next);
        Ok(logits)
    }
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn tag_line(s: &RouteStats) -> String {
    let mut line = String::new();
    for t in &s.tags {
        line += &format!(" {}={:.1}", t.tag, mib(t.live_bytes));
    }
    line
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let steps: usize = arg(&args, "--steps").map_or(Ok(96), |s| s.parse())?;
    let dir = PathBuf::from(arg(&args, "--dir").unwrap_or_else(|| {
        std::env::temp_dir()
            .join("elastic-vmm-llama")
            .display()
            .to_string()
    }));
    std::fs::create_dir_all(&dir)?;
    let cfg = config();
    let device = Device::new_cuda(0)?;
    let t = Instant::now();
    let weights = [
        write_weights(&dir, "a", &cfg)?,
        write_weights(&dir, "b", &cfg)?,
    ];
    let file_bytes = std::fs::metadata(&weights[0])?.len();
    println!(
        "weights: 2 random models of {:.0} MiB each in {} ({:.1} s)",
        mib(file_bytes),
        dir.display(),
        t.elapsed().as_secs_f64()
    );
    if args.iter().any(|a| a == "--bench") {
        let rounds: usize = arg(&args, "--rounds").map_or(Ok(3), |s| s.parse())?;
        return bench(&weights[0], &cfg, &device, steps, rounds);
    }
    if args.iter().any(|a| a == "--switch") {
        let rounds: usize = arg(&args, "--rounds").map_or(Ok(4), |s| s.parse())?;
        return switch(&weights, &cfg, &device, steps, rounds, file_bytes);
    }
    two_models(&weights, &cfg, &device, steps, file_bytes)
}

/// Two models whose limits together exceed the budget take turns on the GPU: the one that runs
/// next is woken (at the same addresses: its weights, KV cache and every candle tensor stay
/// valid), the other put to sleep (weights and KV offloaded to pinned host memory). Each turn
/// generates `steps` tokens; every logit must equal an unrouted run of that model alone that
/// never slept.
fn switch(
    weights: &[PathBuf; 2],
    cfg: &Config,
    device: &Device,
    steps: usize,
    rounds: usize,
    file_bytes: u64,
) -> Res<()> {
    let total = steps * rounds;
    let mut reference = Vec::new();
    for w in weights {
        let mut s = Session::new(w, cfg, device)?;
        let logits: Vec<Vec<f32>> = (0..total).map(|_| s.step()).collect::<Res<_>>()?;
        reference.push(logits);
    }
    device.synchronize()?;
    let limit = file_bytes * 3 / 2;
    let budget = file_bytes * 7 / 4; // one model resident at a time
    let backend = Arc::new(CudaBackend::new(0)?);
    let gpu = SharedPool::new(backend, SharedPoolConfig::new().global_limit(budget))?;
    let models: Vec<ModelHandle> = ["switch-a", "switch-b"]
        .iter()
        .map(|id| gpu.register(ModelConfig::new(*id, 64 << 30, limit)))
        .collect::<Result<_, _>>()?;
    println!(
        "budget {:.0} MiB: two models of {:.0} MiB of weights do not fit together",
        mib(budget),
        mib(file_bytes)
    );
    // Pinned host memory for each model's sleeps, made once, off the switch path.
    for m in &models {
        m.reserve_host_staging(limit)?;
    }
    let policy = SleepPolicy::offload_all();
    let mut sessions: Vec<Option<Session>> = vec![None, None];
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(), Vec::new()];
    let mut switch_ms = Vec::new();
    println!("turn  model     sleep ms  wake ms  GB/s out  GB/s in  tokens");
    for turn in 0..2 * rounds {
        let (i, other) = (turn % 2, 1 - turn % 2);
        let t0 = Instant::now();
        let mut sleep_line = (0.0, 0.0);
        if sessions[other].is_some() {
            device.synchronize()?;
            let r = models[other].sleep(&policy)?;
            sleep_line = (
                r.duration.as_secs_f64() * 1e3,
                r.offloaded as f64 / r.duration.as_secs_f64() / 1e9,
            );
        }
        let mut wake_line = (0.0, 0.0);
        if sessions[i].is_some() {
            let r = models[i].wake(AfterWake::KeepHostMemory)?;
            wake_line = (
                r.duration.as_secs_f64() * 1e3,
                r.restored as f64 / r.duration.as_secs_f64() / 1e9,
            );
        } else {
            let s = route::with_route(&models[i], Tag::Weights, || {
                Session::new(&weights[i], cfg, device)
            })??;
            sessions[i] = Some(s);
        }
        if turn > 1 {
            switch_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let s = sessions[i].as_mut().ok_or("no session")?;
        for _ in 0..steps {
            let l = route::with_route(&models[i], Tag::Activations, || s.step())??;
            logits[i].push(l);
        }
        println!(
            "{turn:>4}  {:<8}  {:>8.1}  {:>7.1}  {:>8.1}  {:>7.1}  {}",
            models[i].id(),
            sleep_line.0,
            wake_line.0,
            sleep_line.1,
            wake_line.1,
            logits[i].len()
        );
        let g = gpu.stats().global;
        if g.used > budget {
            return Err(format!("global use {} over the budget {budget}", g.used).into());
        }
    }
    device.synchronize()?;
    let mut ok = true;
    for i in 0..2 {
        let equal = logits[i]
            .iter()
            .zip(&reference[i])
            .filter(|(a, b)| same_bits(a, b))
            .count();
        println!(
            "{}: {equal}/{total} steps with logits equal bit for bit to a run that never slept",
            models[i].id()
        );
        ok &= equal == total;
    }
    switch_ms.sort_by(f64::total_cmp);
    println!(
        "switch (sleep one model + wake the other, {:.0} MiB each way): median {:.1} ms over {} switches",
        mib(file_bytes),
        switch_ms.get(switch_ms.len() / 2).copied().unwrap_or(0.0),
        switch_ms.len()
    );
    drop(sessions);
    if ok {
        println!("PASS");
        Ok(())
    } else {
        Err("a model's logits changed across sleep and wake".into())
    }
}

fn two_models(
    weights: &[PathBuf; 2],
    cfg: &Config,
    device: &Device,
    steps: usize,
    file_bytes: u64,
) -> Res<()> {
    // Reference: each model alone, candle's own allocator.
    let mut reference = Vec::new();
    for w in weights {
        let mut s = Session::new(w, cfg, device)?;
        let logits: Vec<Vec<f32>> = (0..steps).map(|_| s.step()).collect::<Res<_>>()?;
        reference.push((logits, s.tokens.clone()));
    }
    device.synchronize()?;

    // Routed: both models in one shared pool whose budget is below the sum of their limits.
    let limit = file_bytes * 3 / 2;
    let budget = file_bytes * 5 / 2;
    let backend = Arc::new(CudaBackend::new(0)?);
    let gpu = SharedPool::new(backend, SharedPoolConfig::new().global_limit(budget))?;
    let models: Vec<ModelHandle> = ["llama-a", "llama-b"]
        .iter()
        .map(|id| gpu.register(ModelConfig::new(*id, 64 << 30, limit)))
        .collect::<Result<_, _>>()?;
    println!(
        "budget {:.0} MiB for two models with limits of {:.0} MiB each (sum {:.0} MiB)",
        mib(budget),
        mib(limit),
        mib(2 * limit)
    );
    let before = route::forwarded_stats();
    let mut sessions = Vec::new();
    for (m, w) in models.iter().zip(weights) {
        let s = route::with_route(m, Tag::Weights, || Session::new(w, cfg, device))??;
        sessions.push(s);
    }
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(), Vec::new()];
    let mut peak_global = gpu.stats().global.used;
    println!("step  model     physical MiB  by tag (live MiB)");
    for step in 0..steps {
        for (i, (s, m)) in sessions.iter_mut().zip(&models).enumerate() {
            let l = route::with_route(m, Tag::Activations, || s.step())??;
            logits[i].push(l);
            peak_global = peak_global.max(gpu.stats().global.used);
        }
        if step % 16 == 0 || step + 1 == steps {
            for m in &models {
                let st = route::stats(m).ok_or("no route stats")?;
                let ms = m.model_stats().ok_or("model gone")?;
                println!(
                    "{step:>4}  {:<8}  {:>12.1} {}",
                    m.id(),
                    mib(ms.used),
                    tag_line(&st)
                );
            }
        }
    }
    device.synchronize()?;
    let after = route::forwarded_stats();
    let mut ok = true;
    for (i, m) in models.iter().enumerate() {
        let equal = logits[i]
            .iter()
            .zip(&reference[i].0)
            .filter(|(a, b)| same_bits(a, b))
            .count();
        let same_tokens = sessions[i].tokens == reference[i].1;
        println!(
            "{}: {equal}/{steps} steps with logits equal bit for bit to the unrouted run, tokens {}",
            m.id(),
            if same_tokens { "equal" } else { "DIFFERENT" }
        );
        ok &= equal == steps && same_tokens;
        let st = route::stats(m).ok_or("no route stats")?;
        let ms = m.model_stats().ok_or("model gone")?;
        println!(
            "  peak physical {:.1} MiB (limit {:.1}); routed allocations {}, reused on their stream {}, pool allocations {}, fences {}",
            mib(ms.peak),
            mib(ms.limit),
            st.tags.iter().map(|t| t.allocations).sum::<u64>(),
            st.tags.iter().map(|t| t.reused).sum::<u64>(),
            st.pool_allocations,
            st.fences
        );
        if let Some(r) = route::report(m, 3) {
            print!("{r}");
        }
        ok &= ms.peak <= ms.limit;
    }
    println!(
        "global: peak use {:.1} MiB (sampled after every step) within the budget of {:.0} MiB: {}; allocations the driver made meanwhile: {}",
        mib(peak_global),
        mib(budget),
        if peak_global <= budget { "yes" } else { "NO" },
        after.allocations - before.allocations
    );
    ok &= peak_global <= budget && after.allocations == before.allocations;
    drop(sessions);
    device.synchronize()?;
    for m in &models {
        route::flush(m);
        let live = route::stats(m).map_or(0, |s| s.live_bytes());
        println!("{}: after drop, live routed bytes {live}", m.id());
        ok &= live == 0;
    }
    if ok {
        println!("PASS");
        Ok(())
    } else {
        Err("routed run differs from the unrouted one (see above)".into())
    }
}

/// Statistics of one decode run.
struct Run {
    step_us: Vec<f64>,
    allocations: u64,
    driver_calls: u64,
    peak_bytes: u64,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The default memory pool's watermarks (what candle's allocations reach through the driver).
fn default_pool_high() -> u64 {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut high: u64 = 0;
    // SAFETY: valid out-pointers; device 0 exists (candle opened it).
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, 0);
        sys::cuMemPoolGetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            &mut high as *mut u64 as *mut _,
        );
    }
    high
}

fn reset_default_pool_high() {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut zero: u64 = 0;
    // SAFETY: as above; setting a watermark to 0 resets it to the current value.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, 0);
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            &mut zero as *mut u64 as *mut _,
        );
    }
}

fn decode(
    weights: &Path,
    cfg: &Config,
    device: &Device,
    steps: usize,
    model: Option<&ModelHandle>,
) -> Res<Run> {
    let mut s = match model {
        Some(m) => route::with_route(m, Tag::Weights, || Session::new(weights, cfg, device))??,
        None => Session::new(weights, cfg, device)?,
    };
    // Warm: the prompt and a few steps.
    for _ in 0..4 {
        match model {
            Some(m) => route::with_route(m, Tag::Activations, || s.step())??,
            None => s.step()?,
        };
    }
    device.synchronize()?;
    let f0 = route::forwarded_stats();
    let r0 = model.and_then(|m| route::stats(m));
    let p0 = model.map(|m| m.stats().driver_calls.total());
    if model.is_none() {
        reset_default_pool_high();
    }
    let mut step_us = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t = Instant::now();
        match model {
            Some(m) => route::with_route(m, Tag::Activations, || s.step())??,
            None => s.step()?,
        };
        step_us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    device.synchronize()?;
    let f1 = route::forwarded_stats();
    let forwarded = (f1.allocations - f0.allocations) + (f1.frees - f0.frees);
    let run = match model {
        Some(m) => {
            let r1 = route::stats(m).ok_or("no route stats")?;
            let r0 = r0.ok_or("no route stats")?;
            let allocs: u64 = r1.tags.iter().map(|t| t.allocations).sum::<u64>()
                - r0.tags.iter().map(|t| t.allocations).sum::<u64>();
            let pool_calls = m.stats().driver_calls.total() - p0.unwrap_or(0);
            Run {
                step_us,
                allocations: allocs,
                driver_calls: pool_calls + (r1.fences - r0.fences) + forwarded,
                peak_bytes: m.model_stats().ok_or("model gone")?.peak,
            }
        }
        None => Run {
            step_us,
            allocations: f1.allocations - f0.allocations,
            driver_calls: forwarded,
            peak_bytes: default_pool_high(),
        },
    };
    drop(s);
    device.synchronize()?;
    Ok(run)
}

fn bench(weights: &Path, cfg: &Config, device: &Device, steps: usize, rounds: usize) -> Res<()> {
    let backend = Arc::new(CudaBackend::new(0)?);
    let gpu = SharedPool::new(backend, SharedPoolConfig::new())?;
    let model = gpu.register(ModelConfig::new("bench", 64 << 30, 4 << 30))?;
    println!(
        "decode step, {} layers, bf16, {steps} steps per run after 4 warm steps, {rounds} rounds (interleaved)",
        cfg.num_hidden_layers
    );
    println!("round  allocator  median step µs  allocs/step  driver calls/step  peak MiB");
    let mut ratios = Vec::new();
    let (mut default_steps, mut routed_steps) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let d = decode(weights, cfg, device, steps, None)?;
        let r = decode(weights, cfg, device, steps, Some(&model))?;
        let (mut dt, mut rt) = (d.step_us.clone(), r.step_us.clone());
        let (dm, rm) = (median(&mut dt), median(&mut rt));
        for (name, run, m) in [("default", &d, dm), ("routed", &r, rm)] {
            println!(
                "{round:>5}  {name:<9}  {m:>14.1}  {:>11.2}  {:>17.3}  {:>8.1}",
                run.allocations as f64 / steps as f64,
                run.driver_calls as f64 / steps as f64,
                mib(run.peak_bytes)
            );
        }
        ratios.push(dm / rm);
        default_steps.push(dm);
        routed_steps.push(rm);
        route::flush(&model);
    }
    println!(
        "routed step speed against candle's default allocator: {}",
        ratios
            .iter()
            .map(|r| format!("{r:.3}x"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    // The headline line the README's results table is generated from (see tests/results.rs).
    let (d, r) = (median(&mut default_steps), median(&mut routed_steps));
    println!(
        "RESULT|candle/decode|Llama decode step ({} layers, bf16), allocations routed into a model|{r:.0} us|candle's own CUDA allocator|{d:.0} us|{:.2}x",
        cfg.num_hidden_layers,
        d / r
    );
    Ok(())
}
