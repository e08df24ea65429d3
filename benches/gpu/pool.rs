//! Core pool on the GPU against the driver, in one run:
//! - hot allocate+free: elastic-vmm vs `cuMemAllocAsync`+`cuMemFreeAsync` (cudarc's and candle's
//!   stream-ordered pool) vs `cuMemAlloc`+`cuMemFree`;
//! - growth of 8 GiB in 2 MiB steps and in one request vs the raw per-page driver path
//!   (`cuMemCreate` + `cuMemMap` + `cuMemSetAccess` for every 2 MiB page), and the give-back.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, sys, CudaContext};
use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::{Backend, Pool, PoolConfig};

use crate::{median, ratio_line, BoxError, GIB, MIB};

/// Nanoseconds per iteration of `f`, over `n` iterations.
fn per_iter_ns(n: usize, mut f: impl FnMut()) -> f64 {
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

pub fn run() -> Result<(), BoxError> {
    let backend: Arc<dyn Backend> = Arc::new(CudaBackend::new(0)?);
    let ctx = CudaContext::new(0)?;
    ctx.bind_to_thread()?;
    let stream = ctx.new_stream()?;
    println!("== core pool: {} ==", backend.info().device_name);

    // ---- hot allocate + free ----
    for size in [4096usize, 2 * MIB as usize, 64 * MIB as usize] {
        let pool = Pool::new(backend.clone(), PoolConfig::new(64 * GIB as usize))?;
        drop(pool.allocate(size)?);
        let calls = pool.stats().driver_calls;
        let mut err = None;
        let elastic = median(5, || {
            per_iter_ns(200_000, || match pool.allocate(size) {
                Ok(a) => drop(a),
                Err(e) => err = Some(e),
            })
        });
        if let Some(e) = err {
            return Err(e.into());
        }
        let hot_calls = pool.stats().driver_calls.since(&calls).total();
        let cu = stream.cu_stream();
        // Warm the default memory pool first, as candle's allocations do.
        // SAFETY: plain stream-ordered allocation and free on our stream.
        unsafe { result::free_async(result::malloc_async(cu, size)?, cu)? };
        stream.synchronize()?;
        let asynch = median(5, || {
            let ns = per_iter_ns(20_000, || {
                // SAFETY: as above; the pointer is freed right away on the same stream.
                unsafe {
                    if let Ok(p) = result::malloc_async(cu, size) {
                        let _ = result::free_async(p, cu);
                    }
                }
            });
            let _ = stream.synchronize();
            ns
        });
        let plain = median(3, || {
            per_iter_ns(300, || {
                // SAFETY: plain allocation freed right away.
                unsafe {
                    if let Ok(p) = result::malloc_sync(size) {
                        let _ = result::free_sync(p);
                    }
                }
            })
        });
        println!(
            "hot allocate+free {:>9}, one at a time: elastic-vmm {:8.1} ns ({} driver calls in 1M pairs) | cuMemAllocAsync+FreeAsync {:8.1} ns | cuMemAlloc+Free {:9.1} ns",
            crate::human(size as u64),
            elastic,
            hot_calls,
            asynch,
            plain
        );
        ratio_line(
            "  elastic-vmm vs cuMemAllocAsync+FreeAsync",
            asynch,
            elastic,
        );
        ratio_line("  elastic-vmm vs cuMemAlloc+Free", plain, elastic);
        if size == 2 * MIB as usize {
            crate::result(
                "pool/hot-pair",
                "hot allocate+free, 2 MiB",
                format!("{elastic:.0} ns"),
                "cuMemAllocAsync+FreeAsync",
                format!("{asynch:.0} ns"),
                asynch / elastic,
            );
        }

        // Batch pattern of a serving step: 256 blocks live at once, all freed, stream synced.
        const BATCH: usize = 256;
        let mut held = Vec::with_capacity(BATCH);
        let elastic_b = median(5, || {
            let t = Instant::now();
            for _ in 0..20 {
                for _ in 0..BATCH {
                    match pool.allocate(size) {
                        Ok(a) => held.push(a),
                        Err(e) => err = Some(e),
                    }
                }
                held.clear();
            }
            t.elapsed().as_nanos() as f64 / (20 * BATCH) as f64
        });
        let mut ptrs = Vec::with_capacity(BATCH);
        let asynch_b = median(5, || {
            let t = Instant::now();
            for _ in 0..20 {
                for _ in 0..BATCH {
                    // SAFETY: stream-ordered allocations freed below on the same stream.
                    if let Ok(p) = unsafe { result::malloc_async(cu, size) } {
                        ptrs.push(p);
                    }
                }
                for p in ptrs.drain(..) {
                    // SAFETY: allocated above on this stream.
                    let _ = unsafe { result::free_async(p, cu) };
                }
                let _ = stream.synchronize();
            }
            t.elapsed().as_nanos() as f64 / (20 * BATCH) as f64
        });
        if let Some(e) = err.take() {
            return Err(e.into());
        }
        println!(
            "hot allocate+free {:>9}, {BATCH} live then all freed (+ stream sync): elastic-vmm {:8.1} ns | cuMemAllocAsync+FreeAsync {:8.1} ns",
            crate::human(size as u64),
            elastic_b,
            asynch_b
        );
        ratio_line(
            "  elastic-vmm vs cuMemAllocAsync+FreeAsync, batch",
            asynch_b,
            elastic_b,
        );
    }

    // ---- growth: 8 GiB in 2 MiB steps, and in one request ----
    const TOTAL: u64 = 8 * GIB;
    let steps = (TOTAL / (2 * MIB)) as usize;
    let gib_s = |secs: f64| TOTAL as f64 / GIB as f64 / secs;

    let mut step_times = Vec::new();
    let mut bulk_times = Vec::new();
    let mut raw_bulk_times = Vec::new();
    let mut trim_times = Vec::new();
    let mut warm_times = Vec::new();
    let mut chunks_used = 0;
    for round in 0..4 {
        let pool = Pool::new(backend.clone(), PoolConfig::new(64 * GIB as usize))?;
        let t = Instant::now();
        let mut v = Vec::with_capacity(steps);
        for _ in 0..steps {
            v.push(pool.allocate(2 * MIB as usize)?);
        }
        step_times.push(t.elapsed().as_secs_f64());
        chunks_used = pool.stats().mapped_chunks;
        drop(v);
        // Regrowth from idle memory: the hot path again.
        let t = Instant::now();
        let mut v = Vec::with_capacity(steps);
        for _ in 0..steps {
            v.push(pool.allocate(2 * MIB as usize)?);
        }
        warm_times.push(t.elapsed().as_secs_f64());
        drop(v);
        let t = Instant::now();
        pool.trim()?;
        trim_times.push(t.elapsed().as_secs_f64());
        // 8 GiB in one request, and one raw 8 GiB handle, in turn first right after memory went
        // back to the driver. What the same create costs depends on the driver's state (on the
        // H100, one raw 8 GiB cuMemCreate took 0.07 ms or 26 ms: issue 34), so both are measured
        // in the same states and compared round by round.
        let bulk = || -> Result<f64, BoxError> {
            let t = Instant::now();
            let a = pool.allocate(TOTAL as usize)?;
            let secs = t.elapsed().as_secs_f64();
            drop(a);
            pool.trim()?;
            Ok(secs)
        };
        if round % 2 == 0 {
            bulk_times.push(bulk()?);
            raw_bulk_times.push(raw_growth(&backend, TOTAL, 1)?.0);
        } else {
            raw_bulk_times.push(raw_growth(&backend, TOTAL, 1)?.0);
            bulk_times.push(bulk()?);
        }
    }
    let rounds: Vec<String> = bulk_times
        .iter()
        .zip(&raw_bulk_times)
        .map(|(ours, raw)| format!("{:.3}/{:.3}", ours * 1e3, raw * 1e3))
        .collect();
    let steps_s = median_of(&mut step_times);
    // Best of the rounds on both sides: the driver's slow states (a raw 8 GiB handle took
    // 0.35-0.45 ms in some rounds and 22-67 ms in others of the same H100 run) made medians of
    // either side swing 50x between runs; the best is what the path can do.
    let bulk_s = best_of(&bulk_times);
    let raw_bulk_s = best_of(&raw_bulk_times);
    let trim_s = median_of(&mut trim_times);
    let warm_s = median_of(&mut warm_times);

    // Range API, kvcached-style: one 2 MiB page per map call, cold and from the chunk cache.
    let pool = Pool::new(backend.clone(), PoolConfig::new(64 * GIB as usize))?;
    let t = Instant::now();
    for i in 0..steps as u64 {
        pool.map(i * 2 * MIB, 2 * MIB)?;
    }
    let range_cold_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for i in 0..steps as u64 {
        pool.unmap(i * 2 * MIB, 2 * MIB)?;
    }
    let range_unmap_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for i in 0..steps as u64 {
        pool.map(i * 2 * MIB, 2 * MIB)?;
    }
    let range_cached_s = t.elapsed().as_secs_f64();
    drop(pool);

    // The raw per-page driver path, as floor.
    let (raw_page_s, raw_page_release_s) = raw_growth(&backend, 2 * MIB, steps)?;

    println!(
        "growth 8 GiB in 2 MiB steps: elastic-vmm {:.2} ms = {:.0} GiB/s ({} chunks mapped) | raw per-page create+map+access {:.2} ms = {:.0} GiB/s",
        steps_s * 1e3,
        gib_s(steps_s),
        chunks_used,
        raw_page_s * 1e3,
        gib_s(raw_page_s)
    );
    ratio_line(
        "  elastic-vmm 2 MiB steps vs raw per-page path",
        raw_page_s,
        steps_s,
    );
    crate::result(
        "pool/growth",
        "growth of 8 GiB in 2 MiB steps",
        format!("{:.0} GiB/s", gib_s(steps_s)),
        "raw per-page cuMemCreate+Map+SetAccess",
        format!("{:.0} GiB/s", gib_s(raw_page_s)),
        raw_page_s / steps_s,
    );
    println!(
        "  regrowth from idle memory (no driver call): {:.2} ms = {:.0} GiB/s",
        warm_s * 1e3,
        gib_s(warm_s)
    );
    println!(
        "growth 8 GiB in one request (best of {} rounds each): elastic-vmm {:.3} ms = {:.0} GiB/s | raw one 8 GiB handle {:.3} ms = {:.0} GiB/s",
        bulk_times.len(),
        bulk_s * 1e3,
        gib_s(bulk_s),
        raw_bulk_s * 1e3,
        gib_s(raw_bulk_s)
    );
    println!(
        "  each round, elastic-vmm/raw 8 GiB handle (ms): {}",
        rounds.join(" ")
    );
    ratio_line(
        "  elastic-vmm bulk vs raw per-page path",
        raw_page_s,
        bulk_s,
    );
    crate::result(
        "pool/bulk-growth",
        "growth of 8 GiB in one request, best of 4 rounds",
        format!("{:.3} ms", bulk_s * 1e3),
        "one raw 8 GiB cuMemCreate+Map+SetAccess",
        format!("{:.3} ms", raw_bulk_s * 1e3),
        raw_bulk_s / bulk_s,
    );
    // The guard of issue 34: one request of 8 GiB took 30x one raw handle unnoticed.
    let bulk_ok = bulk_s <= BULK_LIMIT * raw_bulk_s;
    println!(
        "  check: 8 GiB in one request {:.3} ms against {BULK_LIMIT}x one raw 8 GiB handle ({:.3} ms): {}",
        bulk_s * 1e3,
        BULK_LIMIT * raw_bulk_s * 1e3,
        if bulk_ok { "ok" } else { "FAILED" }
    );
    println!(
        "give back 8 GiB (trim): elastic-vmm {:.2} ms | raw per-page unmap+release {:.2} ms",
        trim_s * 1e3,
        raw_page_release_s * 1e3
    );
    println!(
        "range API, 2 MiB page per map call: cold {:.1} ms = {:.0} GiB/s ({:.1} us/page); unmap {:.1} us/page; remap from chunk cache {:.1} ms = {:.0} GiB/s ({:.1} us/page)",
        range_cold_s * 1e3,
        gib_s(range_cold_s),
        range_cold_s * 1e6 / steps as f64,
        range_unmap_s * 1e6 / steps as f64,
        range_cached_s * 1e3,
        gib_s(range_cached_s),
        range_cached_s * 1e6 / steps as f64
    );
    println!(
        "targets: hot pair <= 500 ns and >= 15x cuMemAllocAsync; 2 MiB-step growth >= 170 GiB/s (PyTorch expandable segments); bulk >= 1024 GiB/s"
    );
    if !bulk_ok {
        return Err(format!(
            "growth of 8 GiB in one request took {:.3} ms, more than {BULK_LIMIT}x one raw 8 GiB handle ({:.3} ms)",
            bulk_s * 1e3,
            raw_bulk_s * 1e3
        )
        .into());
    }
    Ok(())
}

/// Most times one raw 8 GiB handle (create + map + access) that a pool's growth of 8 GiB in one
/// request may take.
const BULK_LIMIT: f64 = 4.0;

/// The smallest of `v` (a time: the best round).
fn best_of(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn median_of(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Reserve, then create + map + set access `count` handles of `size` bytes; returns the seconds
/// that took and the seconds to unmap + release them again.
fn raw_growth(backend: &Arc<dyn Backend>, size: u64, count: usize) -> Result<(f64, f64), BoxError> {
    let ordinal = backend.info().device_ordinal.unwrap_or(0);
    let total = size * count as u64;
    // SAFETY: plain data, zero is the documented default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    // SAFETY: plain data.
    let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    desc.location = prop.location;
    desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    let mut va: sys::CUdeviceptr = 0;
    // SAFETY: out-pointers are valid; every handle made here is unmapped and released below.
    unsafe {
        sys::cuMemAddressReserve(&mut va, total as usize, 0, 0, 0).result()?;
        let mut handles = Vec::with_capacity(count);
        let t = Instant::now();
        for i in 0..count {
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            sys::cuMemCreate(&mut h, size as usize, &prop, 0).result()?;
            let at = va + i as u64 * size;
            sys::cuMemMap(at, size as usize, 0, h, 0).result()?;
            sys::cuMemSetAccess(at, size as usize, &desc, 1).result()?;
            handles.push(h);
        }
        let grow = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for (i, h) in handles.into_iter().enumerate() {
            sys::cuMemUnmap(va + i as u64 * size, size as usize).result()?;
            sys::cuMemRelease(h).result()?;
        }
        let shrink = t.elapsed().as_secs_f64();
        sys::cuMemAddressFree(va, total as usize).result()?;
        Ok((grow, shrink))
    }
}
