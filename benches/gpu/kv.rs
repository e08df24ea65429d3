//! The paged KV cache (`elastic_vmm::kv::PagedKv`) on the GPU, a Llama-8B-like shape (32
//! layers, 8 KV heads of 128, 16 tokens per block, f16: 64 KiB per block per layer):
//! - steady state: `alloc`/`free` of 1, 16 and 256 blocks with warm blocks kept by the
//!   watermark thread, against a static cache's free list (what an engine with a preallocated
//!   tensor does); driver calls counted with `backend::counting` (target: none, <= 1 us per
//!   block);
//! - the cold path: the first `alloc` of 16 and 256 blocks with and without pre-mapping (the
//!   median of 3 rounds);
//! - the idle footprint after a spike (sequences of random lengths up to 80% of the cache,
//!   90% of them finished in random order) against the packed floor of the live blocks plus
//!   the low watermark (target <= 1.1x), before and after `PagedKv::compact` (bounded steps,
//!   the survivors' ids renamed; its time, MiB moved and GB/s), its give-back against the
//!   driver calls a page's give-back needs, made raw in the same run.
//!
//! `RESULT` lines (for `--check`): the steady alloc+free of 16 blocks against the 1 us target,
//! the cold alloc of 16 blocks pre-mapped against without, the footprint after compaction
//! against the packed floor, the compaction's longest call against the 10 ms target, its copies
//! against one raw device-to-device copy of as many bytes, and its give-back (after the calls,
//! on a background thread) against the raw driver calls.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use elastic_vmm::backend::counting::Counter;
use elastic_vmm::backend::cuda::CudaBackend;
use elastic_vmm::backend::intercept::{Call, Hook, Intercept, Outcome};
use elastic_vmm::kv::{PagedKv, PagedKvConfig, Watermarks};
use elastic_vmm::{Backend, BackendInfo, Pool, PoolConfig};

use crate::{human, median, BoxError, GIB};

const MAX_BLOCKS: usize = 8192;

/// Counts driver calls (as `Counting` does) and sums the wall time spent inside them, by kind:
/// what of the cold path is the driver's and what is ours.
#[derive(Debug, Default)]
struct Clocked {
    counter: Counter,
    /// Nanoseconds in create, map, set-access and every other VMM call.
    ns: [AtomicU64; 4],
}

impl Clocked {
    fn ns(&self) -> [u64; 4] {
        std::array::from_fn(|i| self.ns[i].load(Ordering::Relaxed))
    }
}

impl Hook for Clocked {
    type Pass = Instant;

    fn before(&self, call: &Call, upstream: &BackendInfo) -> elastic_vmm::Result<Instant> {
        self.counter.before(call, upstream)?;
        Ok(Instant::now())
    }

    fn after(&self, call: &Call, started: Instant, outcome: Outcome<'_>) {
        let took = started.elapsed().as_nanos() as u64;
        let kind = match call {
            Call::Create { .. } => 0,
            Call::Map { .. } => 1,
            Call::SetAccess { .. } => 2,
            _ => 3,
        };
        self.ns[kind].fetch_add(took, Ordering::Relaxed);
        self.counter.after(call, (), outcome);
    }
}

fn config() -> PagedKvConfig {
    PagedKvConfig::new(32, 8, 128, 16, 2, MAX_BLOCKS)
}

fn wait_for(what: &str, f: impl Fn() -> bool) -> Result<(), BoxError> {
    let t = Instant::now();
    while !f() {
        if t.elapsed() > Duration::from_secs(20) {
            return Err(format!("{what}: not within 20 s").into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// A static cache's block allocator: a free list over preallocated blocks.
struct FreeList(Vec<usize>);

impl FreeList {
    fn alloc(&mut self, n: usize) -> Vec<usize> {
        let at = self.0.len() - n;
        self.0.split_off(at)
    }
    fn free(&mut self, ids: &[usize]) {
        self.0.extend_from_slice(ids);
    }
}

pub fn run() -> Result<(), BoxError> {
    println!(
        "== kv: paged KV cache (32 layers x 8 heads x 128 x 16 tokens f16, {MAX_BLOCKS} blocks)"
    );
    let counting = Arc::new(Intercept::with_hook(
        Arc::new(CudaBackend::new(0)?),
        Clocked::default(),
    ));
    let backend: Arc<dyn Backend> = counting.clone();
    let pool = Pool::new(backend, PoolConfig::new(80 * GIB as usize).name("kv"))?;

    // Steady state.
    let w = Watermarks {
        low: 512,
        high: 1024,
        idle_after: Duration::from_secs(600),
        tick: Duration::from_millis(5),
    };
    let kv = PagedKv::new(&pool, config().watermarks(w))?;
    wait_for("warm blocks", || kv.stats().warm >= 512)?;
    let mut list = FreeList((0..MAX_BLOCKS).collect());
    for n in [1usize, 16, 256] {
        let ids = kv.alloc(n)?;
        kv.free(&ids)?;
        // From high, up to high - low blocks are served warm without a refill.
        wait_for("refill", || kv.stats().warm >= 1024)?;
        let rounds = 2000 / n.max(8) + 20;
        let before = counting.hook().counter.counts();
        let ours = median(5, || {
            let t = Instant::now();
            for _ in 0..rounds {
                let ids = kv.alloc(n).expect("alloc");
                kv.free(&ids).expect("free");
            }
            t.elapsed().as_secs_f64() * 1e9 / (rounds * n) as f64
        });
        let calls = counting.hook().counter.counts().since(&before).total();
        let stat = median(5, || {
            let t = Instant::now();
            for _ in 0..rounds {
                let ids = list.alloc(n);
                list.free(std::hint::black_box(&ids));
            }
            t.elapsed().as_secs_f64() * 1e9 / (rounds * n) as f64
        });
        println!(
            "steady alloc+free of {n:>3} blocks: {ours:8.1} ns/block (static free list {stat:6.1} ns/block), driver calls {calls} (target 0, <= 1000 ns/block)"
        );
        if n == 16 {
            // Against the target, not the free list: a free list's fraction of a nanosecond
            // swings by multiples from run to run, the target does not.
            crate::result(
                "kv/steady-alloc-free",
                "paged KV alloc+free of 16 blocks, warm (no driver call)",
                format!("{ours:.1} ns/block"),
                "the target",
                "1000 ns/block".into(),
                1000.0 / ours,
            );
        }
    }
    drop(kv);

    // Cold path: the median of 3 rounds of each (one cold sample swings by 10-20%).
    for n in [16usize, 256] {
        let mut rounds = Vec::new();
        // The first alloc of `n` blocks from `kv`: its time and driver calls; then all back.
        let first_alloc = |kv: PagedKv| -> Result<(Duration, u64), BoxError> {
            let before = counting.hook().counter.counts();
            let ns_before = counting.hook().ns();
            let t = Instant::now();
            let ids = kv.alloc(n)?;
            let took = t.elapsed();
            let calls = counting.hook().counter.counts().since(&before).total();
            let ns = counting.hook().ns();
            let us = |i: usize| (ns[i] - ns_before[i]) as f64 / 1e3;
            println!(
                "  first alloc of {n} blocks: {:.1} us, in the driver {:.1} us (create {:.1}, map {:.1}, set-access {:.1}, other {:.1}), {calls} calls",
                took.as_secs_f64() * 1e6,
                us(0) + us(1) + us(2) + us(3),
                us(0),
                us(1),
                us(2),
                us(3)
            );
            kv.free(&ids)?;
            drop(kv);
            pool.trim()?;
            Ok((took, calls))
        };
        for _ in 0..3 {
            let (cold, calls) = first_alloc(PagedKv::new(&pool, config())?)?;
            let w = Watermarks {
                low: n,
                high: n,
                idle_after: Duration::from_secs(600),
                tick: Duration::from_millis(5),
            };
            let kv = PagedKv::new(&pool, config().watermarks(w))?;
            wait_for("pre-mapped", || kv.stats().warm >= n)?;
            let (warm, warm_calls) = first_alloc(kv)?;
            rounds.push((cold, calls, warm, warm_calls));
        }
        let mid = |mut v: Vec<Duration>| {
            v.sort();
            v[v.len() / 2]
        };
        let cold = mid(rounds.iter().map(|r| r.0).collect());
        let warm = mid(rounds.iter().map(|r| r.2).collect());
        let (calls, warm_calls) = (rounds[0].1, rounds[0].3);
        println!(
            "cold alloc of {n:>3} blocks: {:8.1} us without pre-mapping ({calls} driver calls), {:8.1} us pre-mapped ({warm_calls} driver calls)",
            cold.as_secs_f64() * 1e6,
            warm.as_secs_f64() * 1e6
        );
        if n == 16 {
            crate::result(
                "kv/cold-alloc-premapped",
                "paged KV first alloc of 16 blocks, pre-mapped by the watermarks",
                format!("{:.1} us", warm.as_secs_f64() * 1e6),
                "the same alloc without pre-mapping",
                format!("{:.1} us", cold.as_secs_f64() * 1e6),
                cold.as_secs_f64() / warm.as_secs_f64().max(1e-9),
            );
        }
    }

    // Idle footprint after a spike.
    let w = Watermarks {
        low: 64,
        high: 512,
        idle_after: Duration::from_millis(200),
        tick: Duration::from_millis(10),
    };
    let kv = PagedKv::new(&pool, config().watermarks(w))?;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut seqs: Vec<Vec<usize>> = Vec::new();
    let mut used = 0;
    while used < MAX_BLOCKS * 8 / 10 {
        let len = 1 + next(64) as usize;
        let ids = kv.alloc(len)?;
        used += len;
        seqs.push(ids);
    }
    let peak = kv.stats().mapped_bytes;
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, next(i as u64 + 1) as usize);
    }
    let finish = order.len() * 9 / 10;
    for &i in &order[..finish] {
        kv.free(&seqs[i])?;
    }
    let t = Instant::now();
    wait_for("idle floor", || kv.stats().warm <= 64)?;
    let back = t.elapsed();
    // The trim's unmapping goes on after its blocks left the warm count: wait until the
    // mapped bytes hold still for 200 ms (a compaction skips groups whose blocks are still
    // being released; without the wait it found 141 of the movable blocks on the H100).
    let mut last = kv.stats().mapped_bytes;
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = kv.stats().mapped_bytes;
        if now == last {
            break;
        }
        last = now;
    }
    let s = kv.stats();
    let per_block = s.packed_floor_bytes / s.live.max(1) as u64;
    let floor = s.packed_floor_bytes + 64 * per_block;
    println!(
        "after a spike to {} ({used} blocks): {} live blocks, mapped {} vs packed floor + low {} = {:.2}x (target <= 1.1x), idle floor reached {:.0} ms after the last free",
        human(peak),
        s.live,
        human(s.mapped_bytes),
        human(floor),
        s.mapped_bytes as f64 / floor as f64,
        back.as_secs_f64() * 1e3
    );

    // Compaction: bounded steps until nothing is worth moving, renaming the survivors' ids.
    // Each call returns once its copies are done; its give-back (the unmaps) runs on a
    // background thread, waited for here before the next call so the phases do not overlap
    // (an engine compacting call after call would see the next call share the driver with
    // the last give-back).
    let gain = kv.compaction_gain();
    let (mut calls, mut moved, mut copied, mut released) = (0, 0, 0u64, 0u64);
    let mut longest = Duration::ZERO;
    // Where the time went: backing the destinations, copying (in the calls), giving back
    // (after them, on the give-back's thread).
    let mut phases = [Duration::ZERO; 3];
    let mut total = Duration::ZERO;
    let calls_before = counting.hook().counter.counts();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    loop {
        let c = kv.compact(1024)?;
        released += c.give_back.wait();
        calls += 1;
        moved += c.moves.len();
        copied += c.bytes_copied;
        longest = longest.max(c.elapsed);
        total += c.elapsed;
        let took = c.give_back.took().unwrap_or_default();
        for (p, d) in phases.iter_mut().zip([c.backing, c.copying, took]) {
            *p += d;
        }
        println!(
            "compaction call {calls}: {} blocks moved ({} MiB) in {:.2} ms: backing {:.2} ms, copying {:.2} ms, the rest {:.2} ms; its give-back {} blocks in {:.2} ms after it",
            c.moves.len(),
            c.bytes_copied >> 20,
            ms(c.elapsed),
            ms(c.backing),
            ms(c.copying),
            ms(c.elapsed.saturating_sub(c.backing + c.copying)),
            c.give_back.blocks(),
            ms(took)
        );
        for &i in &order[finish..] {
            for b in &mut seqs[i] {
                *b = c.rename(*b);
            }
        }
        if c.is_empty() || calls >= 64 {
            break;
        }
    }
    let driver = counting.hook().counter.counts().since(&calls_before);
    let after = kv.stats();
    let floor = after.packed_floor_bytes + 64 * per_block;
    println!(
        "compaction (steps of <= 1024 blocks): predicted {} blocks / {} back, did {moved} blocks in {calls} calls, copied {:.1} MiB; the calls took {:.2} ms (longest {:.2} ms: what the engine waits for), their give-backs {:.2} ms after them on a background thread, gave back {}; mapped {} vs packed floor + low {} = {:.2}x (target <= 1.1x)",
        gain.moves,
        human(gain.bytes_released),
        copied as f64 / (1u64 << 20) as f64,
        ms(total),
        ms(longest),
        ms(phases[2]),
        human(released),
        human(after.mapped_bytes),
        human(floor),
        after.mapped_bytes as f64 / floor as f64
    );
    crate::result(
        "kv/compaction-footprint",
        "paged KV mapped after compaction, after a spike",
        human(after.mapped_bytes),
        "packed floor + low watermark",
        human(floor),
        floor as f64 / after.mapped_bytes.max(1) as f64,
    );
    crate::result(
        "kv/compaction-call",
        "paged KV compaction's longest call after a spike (what the engine waits for)",
        format!("{:.2} ms", ms(longest)),
        "the 10 ms target (issue 34)",
        "10 ms".to_string(),
        10.0 / ms(longest).max(1e-6),
    );
    // The copies' peer; a failure loses only its figures.
    let raw = raw_copy(copied.max(1)).unwrap_or_else(|e| {
        println!("raw cuMemcpyDtoD for the compaction's peer failed: {e}");
        f64::NAN
    });
    println!(
        "compaction's time: backing the destinations {:.2} ms, copying {:.2} ms ({:.1} GB/s; one cuMemcpyDtoD of as many bytes {:.2} ms, {:.1} GB/s), the rest of the calls (planning, pinning, books) {:.2} ms; giving back {} {:.2} ms after the calls",
        ms(phases[0]),
        ms(phases[1]),
        copied as f64 / phases[1].as_secs_f64().max(1e-9) / 1e9,
        raw * 1e3,
        copied as f64 / raw / 1e9,
        ms(total.saturating_sub(phases[0] + phases[1])),
        human(released),
        ms(phases[2]),
    );
    if copied > 0 && raw.is_finite() {
        crate::result(
            "kv/compaction-copy",
            "paged KV compaction's copies after a spike (one gather launch per call, waited for)",
            format!("{:.2} ms for {}", ms(phases[1]), human(copied)),
            "one cuMemcpyDtoD of as many bytes",
            format!("{:.2} ms", raw * 1e3),
            raw / phases[1].as_secs_f64().max(1e-9),
        );
    }
    // The give-back's floor: per 2 MiB page, unmap + release, then the zero page mapped
    // read-only where the page was (what a device cache's release does), made raw.
    let page = 2 << 20;
    let pages = released / page;
    if pages > 0 {
        let raw = raw_give_back(page, 256, 0)?;
        let floor = raw * pages as f64;
        // The same with the zero page mapped at as many other places as the cache aliases
        // (its unbacked pages): whether the driver's cost grows with a handle's mappings.
        let aliases = (pool.stats().zero_aliased / page) as usize;
        let loaded = raw_give_back(page, 256, aliases)?;
        println!(
            "compaction's give-back: {pages} pages in {:.2} ms, {:.1} us a page; raw unmap + release + zero-page map + read-only access {:.1} us a page ({:.2} ms for as many), {:.1} us a page with the zero page mapped at {aliases} other places",
            ms(phases[2]),
            phases[2].as_secs_f64() * 1e6 / pages as f64,
            raw * 1e6,
            floor * 1e3,
            loaded * 1e6
        );
        let per_page: Vec<String> = elastic_vmm::DriverCall::ALL
            .iter()
            .filter(|&&k| driver.get(k) > 0)
            .map(|&k| format!("{} {:.2}", k.name(), driver.get(k) as f64 / pages as f64))
            .collect();
        println!(
            "compaction's driver calls (the calls, their give-backs and the look-ahead thread meanwhile), per page given back: {}",
            per_page.join(", ")
        );
        crate::result(
            "kv/compaction-give-back",
            "paged KV compaction giving its evacuated pages back",
            format!("{:.2} ms for {pages} pages", ms(phases[2])),
            "raw unmap + release + zero-page map + read-only access",
            format!("{:.2} ms", floor * 1e3),
            floor / phases[2].as_secs_f64().max(1e-9),
        );
    }
    for &i in &order[finish..] {
        kv.free(&seqs[i])?;
    }
    Ok(())
}

/// Seconds one synchronous `cuMemcpyDtoD` of `bytes` between two `cuMemAlloc` buffers takes
/// on CUDA device 0's primary context (the best of 3, after one untimed copy).
fn raw_copy(bytes: u64) -> Result<f64, BoxError> {
    let ctx = cudarc::driver::CudaContext::new(0)?;
    ctx.bind_to_thread()?;
    let n = usize::try_from(bytes)?;
    let (mut src, mut dst): (sys::CUdeviceptr, sys::CUdeviceptr) = (0, 0);
    // SAFETY: out-pointers are valid; both buffers hold `n` bytes and are freed before Ok; a
    // failed call returns at once and leaks them (a benchmark, whose process then ends).
    unsafe {
        sys::cuMemAlloc_v2(&mut src, n).result()?;
        sys::cuMemAlloc_v2(&mut dst, n).result()?;
        sys::cuMemcpyDtoD_v2(dst, src, n).result()?;
        sys::cuCtxSynchronize().result()?;
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            sys::cuMemcpyDtoD_v2(dst, src, n).result()?;
            sys::cuCtxSynchronize().result()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        sys::cuMemFree_v2(src).result()?;
        sys::cuMemFree_v2(dst).result()?;
        Ok(best)
    }
}

/// Seconds per page of the driver calls that give one `page`-byte page of a device cache
/// back: unmap and release its chunk, then map the zero page read-only in its place; the mean
/// over `count` pages, made raw on CUDA device 0's primary context, with the zero page mapped
/// read-only at `others` other places first (untimed).
fn raw_give_back(page: u64, count: usize, others: usize) -> Result<f64, BoxError> {
    // The primary context, current on this thread for the raw calls.
    let ctx = cudarc::driver::CudaContext::new(0)?;
    ctx.bind_to_thread()?;
    let size = page as usize;
    let total = size * (count + others + 1);
    // SAFETY: plain data, zero is the documented default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    // SAFETY: plain data.
    let mut rw: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    rw.location = prop.location;
    rw.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    let mut ro = rw;
    ro.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ;
    let mut va: sys::CUdeviceptr = 0;
    // SAFETY: out-pointers are valid; the range is reserved here, every handle made here is
    // unmapped and released, and the range freed, before this returns Ok. Nothing else uses
    // the range. A failed driver call returns at once and leaks what was made so far (the
    // range, handles, mappings): accepted in a benchmark, whose process then ends.
    unsafe {
        sys::cuMemAddressReserve(&mut va, total, 0, 0, 0).result()?;
        let mut zero: sys::CUmemGenericAllocationHandle = 0;
        sys::cuMemCreate(&mut zero, size, &prop, 0).result()?;
        let mut handles = Vec::with_capacity(count);
        for i in 0..count {
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            sys::cuMemCreate(&mut h, size, &prop, 0).result()?;
            let at = va + (i * size) as u64;
            sys::cuMemMap(at, size, 0, h, 0).result()?;
            sys::cuMemSetAccess(at, size, &rw, 1).result()?;
            handles.push(h);
        }
        for j in 0..others {
            let at = va + ((count + j) * size) as u64;
            sys::cuMemMap(at, size, 0, zero, 0).result()?;
            sys::cuMemSetAccess(at, size, &ro, 1).result()?;
        }
        let t = Instant::now();
        for (i, h) in handles.into_iter().enumerate() {
            let at = va + (i * size) as u64;
            sys::cuMemUnmap(at, size).result()?;
            sys::cuMemRelease(h).result()?;
            sys::cuMemMap(at, size, 0, zero, 0).result()?;
            sys::cuMemSetAccess(at, size, &ro, 1).result()?;
        }
        let took = t.elapsed().as_secs_f64();
        for i in 0..count + others {
            sys::cuMemUnmap(va + (i * size) as u64, size).result()?;
        }
        sys::cuMemRelease(zero).result()?;
        sys::cuMemAddressFree(va, total).result()?;
        Ok(took / count as f64)
    }
}
