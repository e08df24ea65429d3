//! Sleep and wake on the GPU: 16 GiB of weights offloaded to pinned host memory and copied
//! back at the same addresses, against a raw pinned `cuMemcpyDtoHAsync`/`cuMemcpyHtoDAsync` of
//! the same bytes in the same run (target: wake >= 0.8x raw); then the switch between two
//! models that do not fit together (sleep A + wake B). `SLEEP_GIB` sets the size (default 16).

use std::sync::Arc;
use std::time::{Duration, Instant};

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::{
    AfterWake, Backend, HostStaging, MemOptions, ModelConfig, Pool, PoolConfig, SharedPool,
    SharedPoolConfig, SleepPolicy, Tag,
};

use crate::{human, BoxError, GIB};

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn best(runs: &[Duration]) -> Duration {
    runs.iter().copied().min().unwrap_or_default()
}

/// Raw pinned copies of `bytes` between `dev` and a freshly pinned buffer, best of 3 each way.
fn raw_copies(
    backend: &Arc<dyn Backend>,
    dev: u64,
    bytes: u64,
) -> Result<(Duration, Duration), BoxError> {
    let t = Instant::now();
    let host = backend.copies().staging_alloc(bytes as usize)?;
    println!(
        "pinning {} of host memory (cuMemHostAlloc): {:.2} s (never on the sleep path)",
        human(bytes),
        t.elapsed().as_secs_f64()
    );
    let stream = backend.copies().copy_stream_create()?;
    let mut d2h = Vec::new();
    let mut h2d = Vec::new();
    for _ in 0..3 {
        // SAFETY: `dev` is a live pool allocation of `bytes` bytes mapped with access; `host`
        // is the pinned buffer just made; the copy is waited for before anything else.
        unsafe {
            let t = Instant::now();
            backend
                .copies()
                .copy_to_host_async(host, dev, bytes as usize, stream)?;
            backend
                .copies()
                .marker_wait(backend.copies().marker_record(stream)?)?;
            d2h.push(t.elapsed());
            let t = Instant::now();
            backend
                .copies()
                .copy_from_host_async(dev, host, bytes as usize, stream)?;
            backend
                .copies()
                .marker_wait(backend.copies().marker_record(stream)?)?;
            h2d.push(t.elapsed());
        }
    }
    // SAFETY: every copy on the stream and buffer was waited for above.
    unsafe {
        backend.copies().copy_stream_destroy(stream)?;
        backend.copies().staging_free(host, bytes as usize)?;
    }
    Ok((best(&d2h), best(&h2d)))
}

pub fn run() -> Result<(), BoxError> {
    let backend: Arc<dyn Backend> = Arc::new(CudaBackend::new(0)?);
    let gib: u64 = std::env::var("SLEEP_GIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&g| g > 0)
        .unwrap_or(16);
    let bytes = gib * GIB;
    println!(
        "== sleep and wake: {} of weights on {} ==",
        human(bytes),
        backend.info().device_name
    );
    let p = Pool::new(
        backend.clone(),
        PoolConfig::new((4 * bytes) as usize).name("weights"),
    )?;
    let mut w = p.allocate_with(bytes as usize, &MemOptions::new().tag(Tag::Weights))?;
    w.fill(0x3c)?;
    let (raw_d2h, raw_h2d) = raw_copies(&backend, w.addr(), bytes)?;
    println!(
        "raw pinned copies, best of 3: DtoH {:.1} ms = {:.1} GB/s, HtoD {:.1} ms = {:.1} GB/s",
        raw_d2h.as_secs_f64() * 1e3,
        gbps(bytes, raw_d2h),
        raw_h2d.as_secs_f64() * 1e3,
        gbps(bytes, raw_h2d)
    );
    let t = Instant::now();
    p.reserve_host_staging(bytes)?;
    println!(
        "reserve_host_staging({}): {:.2} s, ahead of any sleep",
        human(bytes),
        t.elapsed().as_secs_f64()
    );
    let policy = SleepPolicy::offload_all().staging(HostStaging::Reserved);
    let (mut sleeps, mut wakes) = (Vec::new(), Vec::new());
    for round in 0..3 {
        let r = p.sleep(&policy)?;
        let free_asleep = backend.memory_info()?.free;
        let wr = p.wake(AfterWake::KeepHostMemory)?;
        let mut head = [0u8; 4096];
        w.read(0, &mut head)?;
        let mut tail = [0u8; 4096];
        w.read(bytes as usize - 4096, &mut tail)?;
        if head.iter().chain(&tail).any(|&b| b != 0x3c) {
            return Err(format!("round {round}: contents differ after wake").into());
        }
        println!(
            "round {round}: sleep {:.1} ms ({} offloaded in {} chunks, device free while asleep {}), wake {:.1} ms ({} restored)",
            r.duration.as_secs_f64() * 1e3,
            human(r.offloaded),
            r.chunks,
            human(free_asleep),
            wr.duration.as_secs_f64() * 1e3,
            human(wr.restored)
        );
        sleeps.push(r.duration);
        wakes.push(wr.duration);
    }
    let (s, wk) = (best(&sleeps), best(&wakes));
    println!(
        "sleep: {:.1} GB/s = {:.2}x raw DtoH; wake: {:.1} GB/s = {:.2}x raw HtoD (target >= 0.80x); {} back in {:.0} ms",
        gbps(bytes, s),
        raw_d2h.as_secs_f64() / s.as_secs_f64(),
        gbps(bytes, wk),
        raw_h2d.as_secs_f64() / wk.as_secs_f64(),
        human(bytes),
        wk.as_secs_f64() * 1e3
    );
    crate::result(
        "sleep/wake",
        &format!("wake {} of weights (host to device)", human(bytes)),
        format!("{:.1} GB/s", gbps(bytes, wk)),
        "raw pinned cuMemcpyHtoD",
        format!("{:.1} GB/s", gbps(bytes, raw_h2d)),
        raw_h2d.as_secs_f64() / wk.as_secs_f64(),
    );
    crate::result(
        "sleep/sleep",
        &format!("sleep {} of weights (device to host)", human(bytes)),
        format!("{:.1} GB/s", gbps(bytes, s)),
        "raw pinned cuMemcpyDtoH",
        format!("{:.1} GB/s", gbps(bytes, raw_d2h)),
        raw_d2h.as_secs_f64() / s.as_secs_f64(),
    );
    drop(w);
    drop(p);
    #[cfg(feature = "candle")]
    {
        let reload = reload_with_candle(bytes)?;
        println!(
            "reloading the same {} from a safetensors file with candle's loader (page cache warm, best of 2): {:.1} ms = {:.1} GB/s; wake is {:.1}x faster",
            human(bytes),
            reload.as_secs_f64() * 1e3,
            gbps(bytes, reload),
            reload.as_secs_f64() / wk.as_secs_f64()
        );
    }

    // Switch: two models of half the size each under a budget that holds one and a half.
    let half = (bytes / 2).max(GIB);
    let shared = SharedPool::new(
        backend.clone(),
        SharedPoolConfig::new().global_limit(half * 3 / 2),
    )?;
    let a = shared.register(ModelConfig::new("a", (4 * half) as usize, half * 3 / 2))?;
    let b = shared.register(ModelConfig::new("b", (4 * half) as usize, half * 3 / 2))?;
    a.reserve_host_staging(half)?;
    b.reserve_host_staging(half)?;
    let mut wa = a.allocate_with(half as usize, &MemOptions::new().tag(Tag::Weights))?;
    wa.fill(1)?;
    a.sleep(&policy)?;
    let mut wb = b.allocate_with(half as usize, &MemOptions::new().tag(Tag::Weights))?;
    wb.fill(2)?;
    let mut switches = Vec::new();
    for i in 0..4 {
        let (from, to) = if i % 2 == 0 { (&b, &a) } else { (&a, &b) };
        let t = Instant::now();
        from.sleep(&policy)?;
        to.wake(AfterWake::KeepHostMemory)?;
        switches.push(t.elapsed());
    }
    let mut byte = [0u8; 1];
    wb.read(0, &mut byte)?;
    if byte[0] != 2 {
        return Err("model b's weights differ after the switches".into());
    }
    let sw = best(&switches);
    println!(
        "switch between two models of {} that do not fit together (sleep one + wake the other): {:.1} ms best of 4 ({:.1} GB/s both ways)",
        human(half),
        sw.as_secs_f64() * 1e3,
        gbps(2 * half, sw)
    );
    drop((wa, wb));
    Ok(())
}

/// Write `bytes` of weights as a safetensors file (1 GiB `U8` tensors) and time
/// `candle_core::safetensors::load` onto the GPU, best of 2 (the second from the page cache).
#[cfg(feature = "candle")]
fn reload_with_candle(bytes: u64) -> Result<Duration, BoxError> {
    use std::io::Write as _;
    let device = candle_core::Device::new_cuda(0)?;
    let path = std::env::temp_dir().join(format!(
        "elastic-vmm-sleep-bench-{}.safetensors",
        std::process::id()
    ));
    let n = bytes.div_ceil(GIB);
    let mut header = String::from("{");
    for i in 0..n {
        let len = GIB.min(bytes - i * GIB);
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            "\"w{i}\":{{\"dtype\":\"U8\",\"shape\":[{len}],\"data_offsets\":[{},{}]}}",
            i * GIB,
            i * GIB + len
        ));
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path)?);
        f.write_all(&(header.len() as u64).to_le_bytes())?;
        f.write_all(header.as_bytes())?;
        let block = vec![0x3cu8; (64 << 20) as usize];
        let mut left = bytes;
        while left > 0 {
            let k = left.min(block.len() as u64) as usize;
            f.write_all(&block[..k])?;
            left -= k as u64;
        }
        f.flush()?;
    }
    let mut runs = Vec::new();
    for _ in 0..2 {
        let t = Instant::now();
        let tensors = candle_core::safetensors::load(&path, &device)?;
        device.synchronize()?;
        runs.push(t.elapsed());
        drop(tensors);
    }
    std::fs::remove_file(&path)?;
    Ok(best(&runs))
}
