//! KV tiers on the GPU: blocks of 64 KiB to 16 MiB moved device -> pinned host and back with
//! `copy_blocks` (every other block, so no run merges: one copy per block) against the same
//! copies made raw with the backend's `copy_to_host_async`/`copy_from_host_async` on one stream
//! (target >= 0.9x at 256 KiB and up); then pinned host <-> disk against raw `O_DIRECT`
//! `pwrite`/`pread` of the same bytes to a file in the same directory on 8 threads, as ours
//! moves them (target >= 0.8x; one thread and the page cache shown too), and, with the `nixl`
//! feature, NIXL's POSIX backend moving the same blocks between the same two layouts
//! (registered as DRAM and FILE; NIXL is given the file's buffered descriptor, so it goes
//! through the page cache).
//! Then the elastic host tier (`Pool::host_tier`): GiB/s made available once per process
//! (`Pool::prefill`: chunks created on several threads, and on one) against `cuMemHostAlloc`
//! of the same bytes (what staging pins per model); device <-> host-tier moves against the
//! same raw copies; and sleep + wake of `TIERS_SLEEP_GIB` (default 16, the spec's size) through
//! the tier (`Pool::stage_through`, host memory given back to the tier at wake) against
//! today's staging pinned ahead per model (`reserve_host_staging`, kept across the wake as
//! staging is used): the tier cold (chunks created on the sleep's path), warm with the memory
//! a previous model gave back, and warm with memory prefilled once for the process. Host
//! memory at most: 16 GiB staging + 16 GiB of the tier + 16 GiB of the one-thread prefill
//! (freed at once); device memory: one 16 GiB model at a time.
//! `TIERS_MIB` sets the bytes moved per case (default 1024), `TIERS_DIR` the directory of the
//! files (default the temp dir). Ratios are raw time / ours (above 1: ours is faster).
//!
//! `RESULT` lines (for `--check`): 256 KiB blocks to and from pinned host memory and to and
//! from the host tier, the paged KV cache to a host-tier cache and back (kernel; cold, and out
//! warm), and sleep + wake through a warm tier against staging. The disk cases print no line:
//! their raw peer is the machine's disk, which differs between lent machines.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::Arc;
use std::time::{Duration, Instant};

use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::layout::{copy_blocks, KvTiers, Layout, LayoutBuilder, LayoutConfig};
use elastic_vmm::{AfterWake, Backend, MemOptions, Pool, PoolConfig, SleepPolicy};

use crate::{BoxError, GIB, MIB};

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn best(mut f: impl FnMut() -> Result<Duration, BoxError>) -> Result<Duration, BoxError> {
    let mut b = Duration::MAX;
    for _ in 0..3 {
        b = b.min(f()?);
    }
    Ok(b)
}

/// The same copies, raw, on one stream of the backend.
fn raw(
    backend: &Arc<dyn Backend>,
    dev: &Layout,
    host: &Layout,
    ids: &[usize],
    to_host: bool,
) -> Result<Duration, BoxError> {
    let c = backend.copies();
    let stream = c.copy_stream_create()?;
    let t = Instant::now();
    for &b in ids {
        let (d, h) = (dev.block(b)?[0], host.block(b)?[0]);
        // SAFETY: views of live layouts (device memory of this backend, its pinned memory),
        // awaited below.
        unsafe {
            if to_host {
                c.copy_to_host_async(h.addr as *mut u8, d.addr, d.len as usize, stream)?;
            } else {
                c.copy_from_host_async(d.addr, h.addr as *const u8, d.len as usize, stream)?;
            }
        }
    }
    // SAFETY: the stream is ours; the marker is waited once.
    unsafe { c.marker_wait(c.marker_record(stream)?)? };
    let e = t.elapsed();
    // SAFETY: everything on it ran.
    unsafe { c.copy_stream_destroy(stream)? };
    Ok(e)
}

/// The same blocks between the same two layouts through NIXL's POSIX backend (DRAM <-> FILE),
/// WRITE to the file and READ back, best of three each;
/// the time is NIXL's, from posting to completion, as `copy_blocks`' is from its first copy.
#[cfg(feature = "nixl")]
fn nixl_posix(host: Layout, disk: Layout, ids: &[usize]) -> Result<(Duration, Duration), BoxError> {
    use elastic_vmm::nixl::{transfer_blocks, BlockSet, NixlAgent, TransferOp};
    // As tests/nixl.rs does it: the FILE registration creates the agent's POSIX backend, then
    // the memory is registered with UCX and POSIX both; NIXL picks POSIX for DRAM <-> FILE.
    let agent = NixlAgent::new("tiers-posix")?;
    let disk = agent.register(disk)?;
    let host = agent.register(host)?;
    let limit = Duration::from_secs(60);
    let go = |op| -> Result<Duration, BoxError> {
        let (h, d) = (
            BlockSet {
                agent: &agent,
                layout: &host,
                blocks: ids,
            },
            BlockSet {
                agent: &agent,
                layout: &disk,
                blocks: ids,
            },
        );
        Ok(transfer_blocks(op, h, d, limit)?.elapsed)
    };
    let w = best(|| go(TransferOp::Write))?;
    let r = best(|| go(TransferOp::Read))?;
    Ok((w, r))
}

pub fn run() -> Result<(), BoxError> {
    let total = std::env::var("TIERS_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024u64)
        * MIB;
    let dir = std::env::var_os("TIERS_DIR")
        .map(Into::into)
        .unwrap_or_else(std::env::temp_dir);
    let backend: Arc<dyn Backend> = Arc::new(CudaBackend::new(0)?);
    if std::env::var("TIERS_ONLY").as_deref() == Ok("paged") {
        return paged_offload(&backend);
    }
    let pool = Pool::new(
        backend.clone(),
        PoolConfig::new(2 * total as usize + 256 * MIB as usize),
    )?;
    println!(
        "== tiers: device <-> pinned host, {} MiB per case, every other block ==",
        total / MIB
    );
    for kib in [64u64, 256, 1024, 4096, 16384] {
        let block = kib << 10;
        let blocks = (total / block).max(4) as usize;
        // 1 layer, 1 outer, 16 tokens, block / 32 elements of 2 bytes: one view per block.
        let c = LayoutConfig::new(blocks, 1, 1, 16, (block / 32) as usize, 2);
        let dev = LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .map_region(&pool, &MemOptions::new())
            .build()?;
        let host = LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .pinned(&pool, true)
            .build()?;
        let ids: Vec<usize> = (0..blocks).step_by(2).collect();
        let bytes = ids.len() as u64 * block;
        // SAFETY: the bench's own layouts, nothing else uses them.
        let ours_d2h = best(|| Ok(unsafe { copy_blocks(&dev, &ids, &host, &ids) }?.elapsed))?;
        let raw_d2h = best(|| raw(&backend, &dev, &host, &ids, true))?;
        // SAFETY: as above.
        let ours_h2d = best(|| Ok(unsafe { copy_blocks(&host, &ids, &dev, &ids) }?.elapsed))?;
        let raw_h2d = best(|| raw(&backend, &dev, &host, &ids, false))?;
        println!(
            "{kib:>6} KiB blocks x {}: D2H ours {:.1} GB/s raw {:.1} GB/s ratio {:.2}x | H2D ours {:.1} GB/s raw {:.1} GB/s ratio {:.2}x",
            ids.len(),
            gbps(bytes, ours_d2h),
            gbps(bytes, raw_d2h),
            raw_d2h.as_secs_f64() / ours_d2h.as_secs_f64(),
            gbps(bytes, ours_h2d),
            gbps(bytes, raw_h2d),
            raw_h2d.as_secs_f64() / ours_h2d.as_secs_f64(),
        );
        if kib == 256 {
            pair_results(
                "tiers/pinned-256k",
                "pinned host",
                bytes,
                [ours_d2h, raw_d2h, ours_h2d, raw_h2d],
            );
        }
    }
    async_move(&pool, total)?;
    println!(
        "== tiers: pinned host <-> disk ({}), {} MiB per case ==",
        dir.display(),
        total / MIB
    );
    for kib in [256u64, 1024, 16384] {
        let block = kib << 10;
        let blocks = (total / block).max(4) as usize;
        let c = LayoutConfig::new(blocks, 1, 1, 16, (block / 32) as usize, 2);
        let host = LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .pinned(&pool, true)
            .build()?;
        let disk = LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .disk_temp(&dir)
            .build()?;
        let ids: Vec<usize> = (0..blocks).step_by(2).collect();
        let bytes = ids.len() as u64 * block;
        // SAFETY: the bench's own layouts.
        let ours_w = best(|| Ok(unsafe { copy_blocks(&host, &ids, &disk, &ids) }?.elapsed))?;
        // SAFETY: as above.
        let ours_r = best(|| Ok(unsafe { copy_blocks(&disk, &ids, &host, &ids) }?.elapsed))?;
        let path = dir.join(format!(".evmm-bench-raw-{}", std::process::id()));
        let open = |direct: bool| -> Result<std::fs::File, BoxError> {
            let mut o = std::fs::OpenOptions::new();
            o.read(true).write(true).create(true);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            Ok(o.open(&path)?)
        };
        let f = open(true)?;
        let buffered = open(false)?;
        f.set_len(c.sizes()?.block * blocks as u64)?;
        let _ = std::fs::remove_file(&path);
        // Raw I/O of the same blocks on `threads` threads, each a share of the blocks in
        // pieces of at most 4 MiB (as ours splits them).
        let io = |f: &std::fs::File, write: bool, threads: usize| -> Result<Duration, BoxError> {
            let mut pieces = Vec::new();
            for &b in &ids {
                let h = host.block(b)?[0];
                let mut at = 0;
                while at < h.len {
                    let len = (h.len - at).min(4 * MIB);
                    pieces.push((h.addr + at, b as u64 * block + at, len));
                    at += len;
                }
            }
            let per = pieces.len().div_ceil(threads);
            let t = Instant::now();
            std::thread::scope(|s| -> Result<(), BoxError> {
                let jobs: Vec<_> = pieces
                    .chunks(per)
                    .map(|share| {
                        s.spawn(move || -> std::io::Result<()> {
                            for &(addr, off, len) in share {
                                // SAFETY: the pinned layout's memory, `len` bytes, used by this
                                // thread alone meanwhile.
                                unsafe {
                                    if write {
                                        f.write_all_at(
                                            std::slice::from_raw_parts(
                                                addr as *const u8,
                                                len as usize,
                                            ),
                                            off,
                                        )?;
                                    } else {
                                        f.read_exact_at(
                                            std::slice::from_raw_parts_mut(
                                                addr as *mut u8,
                                                len as usize,
                                            ),
                                            off,
                                        )?;
                                    }
                                }
                            }
                            Ok(())
                        })
                    })
                    .collect();
                for j in jobs {
                    j.join().map_err(|_| "raw I/O thread panicked")??;
                }
                Ok(())
            })?;
            Ok(t.elapsed())
        };
        let raw_w1 = best(|| io(&f, true, 1))?;
        let raw_r1 = best(|| io(&f, false, 1))?;
        let raw_w = best(|| io(&f, true, 8))?;
        let raw_r = best(|| io(&f, false, 8))?;
        let cached_w = best(|| io(&buffered, true, 8))?;
        let cached_r = best(|| io(&buffered, false, 8))?;
        #[cfg(feature = "nixl")]
        let nixl = match nixl_posix(host, disk, &ids) {
            Ok((w, r)) => format!(
                " | NIXL POSIX write {:.2} GB/s read {:.2} GB/s, ours / NIXL {:.2}x {:.2}x",
                gbps(bytes, w),
                gbps(bytes, r),
                w.as_secs_f64() / ours_w.as_secs_f64(),
                r.as_secs_f64() / ours_r.as_secs_f64(),
            ),
            Err(e) => format!(" | NIXL POSIX: {e}"),
        };
        #[cfg(not(feature = "nixl"))]
        let nixl = {
            drop((host, disk));
            ""
        };
        println!(
            "{kib:>6} KiB blocks x {}: write ours {:.2} GB/s raw O_DIRECT 8 threads {:.2} GB/s ratio {:.2}x (1 thread {:.2} GB/s) | read ours {:.2} GB/s raw 8 threads {:.2} GB/s ratio {:.2}x (1 thread {:.2} GB/s) | page cache 8 threads: write {:.2} read {:.2} GB/s{nixl}",
            ids.len(),
            gbps(bytes, ours_w),
            gbps(bytes, raw_w),
            raw_w.as_secs_f64() / ours_w.as_secs_f64(),
            gbps(bytes, raw_w1),
            gbps(bytes, ours_r),
            gbps(bytes, raw_r),
            raw_r.as_secs_f64() / ours_r.as_secs_f64(),
            gbps(bytes, raw_r1),
            gbps(bytes, cached_w),
            gbps(bytes, cached_r),
        );
    }
    paged_offload(&backend)?;
    host_tier(&backend, &pool, total)?;
    Ok(())
}

/// A paged KV cache's blocks to a cache of the same shape on a host tier and back
/// (`PagedKv::move_to`): 256 scattered blocks of a Llama-8B-shaped cache (32 layers, 16 tokens,
/// f16, 8 KV heads of 128: 32 KiB per block per tensor, 64 tensors; and with 16 heads, 64 KiB),
/// against the same copies made raw, one `copy_to_host_async` (or from) per block per tensor on
/// one stream, as an engine moving per-layer pieces does (ratio raw time / ours); ours with
/// the gather kernel and with the copy engines (`EVMM_TIER_ENGINE`), each cold and warm.
/// `TIERS_ONLY=paged` runs only this.
fn paged_offload(backend: &Arc<dyn Backend>) -> Result<(), BoxError> {
    for heads in [8, 16] {
        for warm in [false, true] {
            for engine in ["kernel", "memcpy"] {
                std::env::set_var("EVMM_TIER_ENGINE", engine);
                paged_offload_once(backend, heads, engine, warm)?;
            }
        }
    }
    std::env::remove_var("EVMM_TIER_ENGINE");
    Ok(())
}

/// One case; `warm`: both caches keep freed blocks mapped (watermarks), so a move maps and
/// unmaps nothing after the first round: the copies alone. Cold: the destination maps its
/// pages and the source gives its back within the move (elastic on both sides).
fn paged_offload_once(
    backend: &Arc<dyn Backend>,
    heads: usize,
    engine: &str,
    warm: bool,
) -> Result<(), BoxError> {
    use elastic_vmm::kv::{PagedKv, PagedKvConfig, Watermarks};
    let config = PagedKvConfig::new(32, heads, 128, 16, 2, 512);
    let config = if warm {
        config.watermarks(Watermarks {
            low: 1,
            high: 512,
            idle_after: Duration::from_secs(600),
            tick: Duration::from_millis(100),
        })
    } else {
        config
    };
    let pool = Pool::new(
        backend.clone(),
        PoolConfig::new(4 * GIB as usize).name("offload-device"),
    )?;
    let kv = PagedKv::new(&pool, config.clone()).map_err(|e| format!("device cache: {e}"))?;
    let tier = Pool::host_tier(0, PoolConfig::new(8 * GIB as usize).name("offload-tier"))?;
    if heads == 8 && engine == "kernel" && !warm {
        // A fact worth knowing: aliasing every unbacked page of a large host-tier cache to one
        // zero chunk (what a device cache does) is refused by CUDA; host-tier caches do not.
        match PagedKv::new(&tier, config.clone().zero_unbacked(true)) {
            Ok(_) => println!(
                "a host-tier cache of {} MiB with its unbacked pages zero-aliased: made",
                512 * 2 * heads / 8
            ),
            Err(e) => println!(
                "a host-tier cache of {} MiB with its unbacked pages zero-aliased: {e}",
                512 * 2 * heads / 8
            ),
        }
    }
    let host = PagedKv::new(&tier, config).map_err(|e| format!("host-tier cache: {e}"))?;
    if warm {
        // The look-ahead threads map every block of both caches first.
        let t = Instant::now();
        while kv.stats().warm < 512 || host.stats().warm < 512 {
            if t.elapsed() > Duration::from_secs(60) {
                return Err("the caches did not warm up in 60 s".into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // Every round starts scattered: 512 blocks taken, every other one given back.
    let scatter = |kv: &PagedKv| -> Result<Vec<usize>, BoxError> {
        let all = kv.alloc(512)?;
        let (live, gone): (Vec<usize>, Vec<usize>) = all.iter().partition(|&&b| b % 2 == 0);
        kv.free(&gone)?;
        Ok(live)
    };
    let span = kv.block_span_bytes();
    let bytes = 256 * span * kv.tensors() as u64;
    let c = backend.copies();
    // Raw: per block, per tensor, into blocks of the other cache.
    let raw = |from: &PagedKv,
               ids: &[usize],
               to: &PagedKv,
               to_host: bool|
     -> Result<Duration, BoxError> {
        let dst = to.alloc(ids.len())?;
        let stream = c.copy_stream_create()?;
        let t = Instant::now();
        for (&s, &d) in ids.iter().zip(&dst) {
            for k in 0..from.tensors() {
                let a = from.tensor_addr(k).ok_or("tensor")? + s as u64 * span;
                let b = to.tensor_addr(k).ok_or("tensor")? + d as u64 * span;
                // SAFETY: live blocks of the two caches (device memory and a host tier of this
                // device), used by nothing else; awaited below.
                unsafe {
                    if to_host {
                        c.copy_to_host_async(b as *mut u8, a, span as usize, stream)?;
                    } else {
                        c.copy_from_host_async(b, a as *const u8, span as usize, stream)?;
                    }
                }
            }
        }
        // SAFETY: ours, waited once.
        unsafe { c.marker_wait(c.marker_record(stream)?)? };
        let e = t.elapsed();
        // SAFETY: idle.
        unsafe { c.copy_stream_destroy(stream)? };
        to.free(&dst)?;
        Ok(e)
    };
    let (mut out, mut back, mut copies) = (Duration::MAX, Duration::MAX, (0, 0));
    // Cold, the source's pages go back on a background thread after the wait: waited for
    // (a trim) outside the timed part, so that no round pays for the one before, and timed.
    let mut given = (Duration::ZERO, Duration::ZERO);
    let settle = |kv: &PagedKv| {
        let t = Instant::now();
        if !warm {
            kv.trim();
        }
        t.elapsed()
    };
    for _ in 0..3 {
        let live = scatter(&kv)?;
        let t = Instant::now();
        let m = kv.move_to(&live, &host)?;
        let on_host = m.destinations().to_vec();
        copies.0 = m.wait()?.copies;
        out = out.min(t.elapsed());
        given.0 = given.0.max(settle(&kv));
        let t = Instant::now();
        let m = host.move_to(&on_host, &kv)?;
        let home = m.destinations().to_vec();
        copies.1 = m.wait()?.copies;
        back = back.min(t.elapsed());
        given.1 = given.1.max(settle(&host));
        kv.free(&home)?;
        settle(&kv);
    }
    let live = scatter(&kv)?;
    let raw_out = best(|| raw(&kv, &live, &host, true))?;
    let held = host.alloc(live.len())?;
    let raw_back = best(|| raw(&host, &held, &kv, false))?;
    host.free(&held)?;
    println!(
        "paged KV to a host-tier cache and back ({engine:>6}, {}), {} scattered blocks of {} MiB ({} MiB, {} pieces of {} KiB; ours {} and {} copies): out ours {:.1} GB/s raw per piece {:.1} GB/s ratio {:.2}x | back ours {:.1} GB/s raw {:.1} GB/s ratio {:.2}x | the source's give-back after the wait (longest): out {:.1} ms, back {:.1} ms",
        if warm { "warm" } else { "cold" },
        live.len(),
        span * kv.tensors() as u64 / MIB,
        bytes / MIB,
        live.len() * kv.tensors(),
        span >> 10,
        copies.0,
        copies.1,
        gbps(bytes, out),
        gbps(bytes, raw_out),
        raw_out.as_secs_f64() / out.as_secs_f64(),
        gbps(bytes, back),
        gbps(bytes, raw_back),
        raw_back.as_secs_f64() / back.as_secs_f64(),
        given.0.as_secs_f64() * 1e3,
        given.1.as_secs_f64() * 1e3,
    );
    if heads == 8 && engine == "kernel" {
        let state = if warm { "warm" } else { "cold" };
        let mut cases = vec![("out", out, raw_out)];
        if !warm {
            cases.push(("back", back, raw_back));
        }
        for (way, ours, peer) in cases {
            copy_result(
                &format!("tiers/paged-kv-{way}-{state}"),
                &format!("paged KV to a host-tier cache, {way}, {state}: 256 scattered blocks, 64 pieces of 32 KiB each"),
                "raw per-piece copies on one stream",
                bytes,
                [ours, peer],
            );
        }
    }
    kv.free(&live)?;
    Ok(())
}

/// A `KvTiers` move of `total` bytes in 4 MiB blocks, device -> pinned host: how soon
/// `start_move` gives the host back, against the whole move.
fn async_move(pool: &Pool, total: u64) -> Result<(), BoxError> {
    let blocks = (total / (4 * MIB)).max(4) as usize;
    let c = LayoutConfig::new(blocks, 1, 1, 16, (4 * MIB / 32) as usize, 2);
    let dev = LayoutBuilder::new()
        .config(c)
        .fully_contiguous()
        .map_region(pool, &MemOptions::new())
        .build()?;
    let host = LayoutBuilder::new()
        .config(c)
        .fully_contiguous()
        .pinned(pool, true)
        .build()?;
    let tiers = KvTiers::new(vec![dev, host])?;
    let ids: Vec<u64> = (0..blocks)
        .map(|_| tiers.insert(0).map(|b| b.0))
        .collect::<Result<_, _>>()?;
    let mut line = String::new();
    for (to, name) in [(1, "D2H"), (0, "H2D")] {
        let t = Instant::now();
        let m = tiers.start_move(&ids, to)?;
        let started = t.elapsed();
        let r = m.wait()?;
        let all = t.elapsed();
        line += &format!(
            " | {name}: start_move returned in {:.1} us, done in {:.2} ms ({:.1} GB/s, {} copy)",
            started.as_secs_f64() * 1e6,
            all.as_secs_f64() * 1e3,
            gbps(r.bytes, all),
            r.copies,
        );
    }
    println!("async KvTiers move of {} MiB{line}", total / MIB);
    Ok(())
}

fn host_tier(backend: &Arc<dyn Backend>, pool: &Pool, total: u64) -> Result<(), BoxError> {
    let gib = std::env::var("TIERS_SLEEP_GIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16u64);
    let bytes = gib * GIB;
    let tier_backend = CudaBackend::host_tier(0)?;
    let tier = Pool::new(
        Arc::new(tier_backend),
        PoolConfig::new(4 * bytes as usize).name("host-tier"),
    )?;
    println!("== host tier: {} ==", tier.backend_info().device_name);
    // Set-up: GiB/s made available, once per process (`prefill`: 1 GiB chunks created on
    // several threads), against the same on one thread; cuMemHostAlloc is timed below, where
    // staging reserves it.
    let t = Instant::now();
    tier.prefill(bytes)?;
    let prefill = t.elapsed();
    let one = Pool::new(
        Arc::new(CudaBackend::host_tier(0)?.create_threads(1)),
        PoolConfig::new(2 * bytes as usize).name("host-tier-1"),
    )?;
    let t = Instant::now();
    one.prefill(bytes)?;
    let one_s = t.elapsed();
    drop(one);
    // Device <-> host tier moves (the prefilled memory stays idle meanwhile).
    for kib in [64u64, 256, 1024, 16384] {
        let block = kib << 10;
        let blocks = (total / block).max(4) as usize;
        let c = LayoutConfig::new(blocks, 1, 1, 16, (block / 32) as usize, 2);
        let dev = LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .map_region(pool, &MemOptions::new())
            .build()?;
        let host = LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .map_region(&tier, &MemOptions::new())
            .build()?;
        let ids: Vec<usize> = (0..blocks).step_by(2).collect();
        let moved = ids.len() as u64 * block;
        // SAFETY: the bench's own layouts.
        let ours_d2h = best(|| Ok(unsafe { copy_blocks(&dev, &ids, &host, &ids) }?.elapsed))?;
        let raw_d2h = best(|| raw(backend, &dev, &host, &ids, true))?;
        // SAFETY: as above.
        let ours_h2d = best(|| Ok(unsafe { copy_blocks(&host, &ids, &dev, &ids) }?.elapsed))?;
        let raw_h2d = best(|| raw(backend, &dev, &host, &ids, false))?;
        println!(
            "{kib:>6} KiB blocks x {} to/from the tier: D2H ours {:.1} GB/s raw {:.1} GB/s ratio {:.2}x | H2D ours {:.1} GB/s raw {:.1} GB/s ratio {:.2}x",
            ids.len(),
            gbps(moved, ours_d2h),
            gbps(moved, raw_d2h),
            raw_d2h.as_secs_f64() / ours_d2h.as_secs_f64(),
            gbps(moved, ours_h2d),
            gbps(moved, raw_h2d),
            raw_h2d.as_secs_f64() / ours_h2d.as_secs_f64(),
        );
        if kib == 256 {
            pair_results(
                "tiers/host-tier-256k",
                "the host tier",
                moved,
                [ours_d2h, raw_d2h, ours_h2d, raw_h2d],
            );
        }
    }
    // Sleep and wake of `bytes` of device memory (one model per pool).
    let sleep_wake = |p: &Pool, after: AfterWake| -> Result<(Duration, Duration), BoxError> {
        let mut a = p.allocate(bytes as usize)?;
        a.fill(0x5A)?;
        let t = Instant::now();
        p.sleep(&SleepPolicy::offload_all())?;
        let s = t.elapsed();
        let t = Instant::now();
        p.wake(after)?;
        let w = t.elapsed();
        drop(a);
        p.trim()?;
        Ok((s, w))
    };
    let cfg = || PoolConfig::new(bytes as usize + GIB as usize);
    // Today's staging: pinned per model ahead of its sleep (cuMemHostAlloc), kept across wakes.
    let staged = Pool::new(backend.clone(), cfg())?;
    let t = Instant::now();
    staged.reserve_host_staging(bytes)?;
    let reserve = t.elapsed();
    let staging = sleep_wake(&staged, AfterWake::KeepHostMemory)?;
    drop(staged);
    println!(
        "set-up of {gib} GiB: host tier prefill {:.2} GiB/s ({:.2} s, chunks created on several threads), on one thread {:.2} GiB/s, cuMemHostAlloc {:.2} GiB/s ({:.2} s, per model for staging) | ratio cuMemHostAlloc / prefill {:.2}x",
        gib as f64 / prefill.as_secs_f64(),
        prefill.as_secs_f64(),
        gib as f64 / one_s.as_secs_f64(),
        gib as f64 / reserve.as_secs_f64(),
        reserve.as_secs_f64(),
        reserve.as_secs_f64() / prefill.as_secs_f64()
    );
    // Through the tier; each model gives its host memory back to the tier as it wakes.
    let through_tier = || -> Result<(Duration, Duration), BoxError> {
        let p = Pool::new(backend.clone(), cfg())?;
        p.stage_through(Some(tier.clone()))?;
        sleep_wake(&p, AfterWake::FreeHostMemory)
    };
    // Warm: the memory prefilled once for the process.
    let prefilled = through_tier()?;
    // Cold: nothing in the tier, chunks created on the sleep's path.
    tier.trim()?;
    let cold = through_tier()?;
    // Warm: the memory the previous model gave back.
    let warm = through_tier()?;
    let (ss, sw) = staging;
    println!(
        "sleep+wake {gib} GiB: staging (pinned ahead, {:.2} s per model) sleep {:.2} s wake {:.2} s",
        reserve.as_secs_f64(),
        ss.as_secs_f64(),
        sw.as_secs_f64()
    );
    for (what, (ts, tw)) in [
        ("tier cold (created on the way)", cold),
        ("tier warm (previous model's memory)", warm),
        ("tier warm (prefilled once per process)", prefilled),
    ] {
        println!(
            "  {what}: sleep {:.2} s wake {:.2} s | ratio staging / tier: sleep {:.2}x wake {:.2}x sleep+wake {:.2}x",
            ts.as_secs_f64(),
            tw.as_secs_f64(),
            ss.as_secs_f64() / ts.as_secs_f64(),
            sw.as_secs_f64() / tw.as_secs_f64(),
            (ss + sw).as_secs_f64() / (ts + tw).as_secs_f64()
        );
    }
    let (ts, tw) = warm;
    crate::result(
        "tiers/sleep-wake-through-tier",
        &format!("sleep + wake of {gib} GiB through a warm host tier"),
        format!("{:.2} s", (ts + tw).as_secs_f64()),
        "staging pinned ahead per model",
        format!("{:.2} s", (ss + sw).as_secs_f64()),
        (ss + sw).as_secs_f64() / (ts + tw).as_secs_f64(),
    );
    Ok(())
}

/// The `RESULT` lines of one block size moved both ways between device memory and `other`:
/// `t` holds ours and raw device-to-host, then ours and raw host-to-device.
fn pair_results(key: &str, other: &str, bytes: u64, t: [Duration; 4]) {
    for (way, ours, raw) in [("d2h", t[0], t[1]), ("h2d", t[2], t[3])] {
        copy_result(
            &format!("{key}-{way}"),
            &format!("256 KiB blocks, every other one, {way} with {other}"),
            "raw async copies, one per block, on one stream",
            bytes,
            [ours, raw],
        );
    }
}

/// One `RESULT` line of `bytes` moved by ours and by `peer` (`t`: ours, then the peer's time),
/// both as GB/s, the ratio the peer's time over ours.
fn copy_result(key: &str, what: &str, peer: &str, bytes: u64, t: [Duration; 2]) {
    crate::result(
        key,
        what,
        format!("{:.1} GB/s", gbps(bytes, t[0])),
        peer,
        format!("{:.1} GB/s", gbps(bytes, t[1])),
        t[1].as_secs_f64() / t[0].as_secs_f64(),
    );
}
