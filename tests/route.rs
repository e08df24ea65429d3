//! Routing on the host backend: the hooks this binary defines (as an application would), called
//! the way cudarc calls them, serving real host memory from host pools. What needs a GPU (the
//! driver behind foreign pointers, events, graph capture, candle) is in the GPU target.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use cudarc::driver::sys::{CUdeviceptr, CUresult, CUstream};
use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::backend::testing::{Delay, DelayInjector};
use elastic_vmm::route::{self, DefaultRoute};
use elastic_vmm::{
    AfterWake, Backend, DriverCall, ModelConfig, Pool, SharedPool, SharedPoolConfig, SleepPolicy,
    SleepStatus, Tag,
};
use parking_lot::Mutex;

elastic_vmm::route_cuda_allocations!();

// The entry points as cudarc declares them; the linker binds them to the macro's definitions.
extern "C" {
    fn cuMemAllocAsync(dptr: *mut CUdeviceptr, bytesize: usize, stream: CUstream) -> CUresult;
    fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) -> CUresult;
    fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult;
    fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult;
    fn cuStreamDestroy_v2(stream: CUstream) -> CUresult;
}

// Tests share process-wide routing state (the default route, forwarding counters): one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const S1: usize = 0x1000;
const S2: usize = 0x2000;
const PER_THREAD: usize = 0x2;

fn alloc(bytes: usize, stream: usize) -> Result<u64, CUresult> {
    let mut p: CUdeviceptr = 0;
    // SAFETY: a valid out-pointer; on the host the stream handle is only a key.
    let r = unsafe { cuMemAllocAsync(&mut p, bytes, stream as CUstream) };
    if r == CUresult::CUDA_SUCCESS {
        Ok(p)
    } else {
        Err(r)
    }
}

fn free(p: u64, stream: usize) -> CUresult {
    // SAFETY: as the driver's contract: `p` came from an allocation (or is foreign on purpose).
    unsafe { cuMemFreeAsync(p, stream as CUstream) }
}

fn host_pool(name: &str) -> Pool {
    let b: Arc<dyn Backend> = Arc::new(HostBackend::new(2 << 20).unwrap());
    Pool::new(b, elastic_vmm::PoolConfig::new(8 << 30).name(name)).unwrap()
}

/// Write a pattern through the raw pointer (real host memory) and read it back.
fn touch(p: u64, bytes: usize, seed: u8) {
    // SAFETY: `p..p+bytes` is a live routed allocation of at least `bytes` bytes of host memory
    // that only this test uses.
    let s = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, bytes) };
    s.fill(seed);
    assert!(s.iter().all(|&b| b == seed));
}

#[test]
fn routes_to_the_pool_with_tags_and_nesting() {
    let _s = SERIAL.lock();
    assert!(route::is_installed());
    let a = host_pool("a");
    let b = host_pool("b");
    let (x, y, z);
    {
        let _ra = route::route(&a, Tag::Weights).unwrap();
        x = alloc(3 << 20, S1).unwrap();
        {
            let _rb = route::route(&b, "draft").unwrap();
            y = alloc(1000, S1).unwrap();
        }
        z = alloc(5000, S1).unwrap();
    }
    for (p, n, s) in [(x, 3 << 20, 1), (y, 1000, 2), (z, 5000, 3)] {
        touch(p, n, s);
        assert!(route::is_routed(p));
    }
    let in_a = |p: u64| p >= a.base() && p < a.base() + a.capacity();
    assert!(in_a(x) && in_a(z) && !in_a(y));
    let sa = route::stats(&a).unwrap();
    let w = sa.tag(&Tag::Weights).unwrap();
    assert_eq!((w.live_blocks, w.live_bytes), (2, (3 << 20) + 5000));
    // The first allocation grew the pool: create, map, set access at least.
    assert!(w.driver_calls >= 3, "{w:?}");
    assert!(sa.driver_calls >= w.driver_calls);
    let sb = route::stats(&b).unwrap();
    assert_eq!(sb.tag(&Tag::named("draft")).unwrap().live_bytes, 1000);
    let report = route::report(&a, 1).unwrap();
    assert_eq!(report.live_blocks, 2);
    assert_eq!(report.largest[0].addr, x);
    assert!(report.to_string().contains("weights"), "{report}");
    // Outside any route, a free of a routed block still goes back to routing.
    for p in [x, y, z] {
        assert_eq!(free(p, S1), CUresult::CUDA_SUCCESS);
        assert!(!route::is_routed(p));
    }
    let sa = route::stats(&a).unwrap();
    assert_eq!(sa.live_bytes(), 0);
    assert_eq!(sa.tag(&Tag::Weights).unwrap().peak_bytes, (3 << 20) + 5000);
    assert!(sa.cached_bytes > 0);
    route::flush(&a);
    route::flush(&b);
    assert_eq!(route::stats(&a).unwrap().cached_bytes, 0);
    assert_eq!(a.stats().in_use, 0);
    assert_eq!(b.stats().in_use, 0);
    a.audit().unwrap();
}

#[test]
fn same_stream_reuse_is_immediate_other_streams_wait_for_a_fence() {
    let _s = SERIAL.lock();
    let pool = host_pool("streams");
    let _r = route::route(&pool, Tag::Activations).unwrap();
    let p = alloc(1 << 20, S1).unwrap();
    assert_eq!(free(p, S1), CUresult::CUDA_SUCCESS);
    // Same stream, same size class: the same block, no pool call.
    let before = route::stats(&pool).unwrap().pool_allocations;
    let q = alloc((1 << 20) - 100, S1).unwrap();
    assert_eq!(q, p);
    let st = route::stats(&pool).unwrap();
    assert_eq!(st.pool_allocations, before);
    assert_eq!(st.tag(&Tag::Activations).unwrap().reused, 1);
    assert_eq!(free(q, S1), CUresult::CUDA_SUCCESS);
    // Another stream must not get it before a fence.
    let r = alloc(1 << 20, S2).unwrap();
    assert_ne!(r, p);
    assert_eq!(free(r, S2), CUresult::CUDA_SUCCESS);
    // A stream's destruction fences what was freed on it (on the host fences pass at once).
    // SAFETY: on the host the handle is only a key; no driver is behind it.
    let _ = unsafe { cuStreamDestroy_v2(S2 as CUstream) };
    // After a flush both are the pool's again, usable by any stream.
    route::flush(&pool);
    let st = route::stats(&pool).unwrap();
    assert_eq!((st.cached_bytes, st.fenced_bytes), (0, 0));
    assert!(st.fences >= 1);
    assert_eq!(pool.stats().in_use, 0);
}

#[test]
fn per_thread_streams_are_different_streams() {
    let _s = SERIAL.lock();
    let pool = host_pool("per-thread");
    let p = {
        let _r = route::route(&pool, Tag::Kv).unwrap();
        let p = alloc(64 << 10, PER_THREAD).unwrap();
        assert_eq!(free(p, PER_THREAD), CUresult::CUDA_SUCCESS);
        p
    };
    let pool2 = pool.clone();
    let q = std::thread::spawn(move || {
        let _r = route::route(&pool2, Tag::Kv).unwrap();
        let q = alloc(64 << 10, PER_THREAD).unwrap();
        assert_eq!(free(q, PER_THREAD), CUresult::CUDA_SUCCESS);
        q
    })
    .join()
    .unwrap();
    assert_ne!(
        p, q,
        "another thread's per-thread stream reused a block without a fence"
    );
    route::flush(&pool);
    assert_eq!(pool.stats().in_use, 0);
}

#[test]
fn out_of_memory_at_the_limit_refuses_with_numbers_and_keeps_nothing() {
    let _s = SERIAL.lock();
    let b: Arc<dyn Backend> = Arc::new(HostBackend::new(2 << 20).unwrap());
    let shared = SharedPool::new(b, SharedPoolConfig::new().global_limit(64 << 20)).unwrap();
    let m = shared
        .register(ModelConfig::new("small", 1 << 30, 16 << 20))
        .unwrap();
    let _r = route::route(&m, Tag::Weights).unwrap();
    let ok = alloc(12 << 20, S1).unwrap();
    let before = shared.stats();
    assert_eq!(alloc(8 << 20, S1), Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    let r = route::last_refusal().expect("refusal kept");
    assert_eq!(
        (r.model.as_str(), r.asked, r.tag.clone()),
        ("small", 8 << 20, Tag::Weights)
    );
    assert_eq!(r.routed_live, 12 << 20);
    assert!(r.reason.contains("limit"), "{r}");
    assert!(route::last_refusal().is_none());
    assert_eq!(route::stats(&m).unwrap().last_refusal, Some(r));
    assert_eq!(
        route::stats(&m)
            .unwrap()
            .tag(&Tag::Weights)
            .unwrap()
            .refusals,
        1
    );
    // Nothing held for the refused allocation.
    assert_eq!(shared.stats().models[0].used, before.models[0].used);
    // Freed blocks the model keeps for reuse go back to its pool before a refusal.
    assert_eq!(free(ok, S1), CUresult::CUDA_SUCCESS);
    let big = alloc(14 << 20, S2).expect("cached blocks flushed on out of memory");
    assert_eq!(free(big, S2), CUresult::CUDA_SUCCESS);
    // A size that cannot be rounded is refused, not a panic.
    assert_eq!(
        alloc(usize::MAX, S1),
        Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY)
    );
    assert!(route::last_refusal().unwrap().reason.contains("overflow"));
    route::flush(&m);
    assert_eq!(m.stats().in_use, 0);
    m.audit().unwrap();
}

#[test]
fn default_route_and_forwarding() {
    let _s = SERIAL.lock();
    let pool = host_pool("default");
    // Outside a route: to the driver (none here), counted as forwarded.
    let f0 = route::forwarded_stats();
    assert!(alloc(4096, S1).is_err());
    let mut p: CUdeviceptr = 0;
    // SAFETY: valid out-pointer.
    let _ = unsafe { cuMemAlloc_v2(&mut p, 4096) };
    // A foreign pointer's free goes to the driver.
    let _ = free(0xdead_0000, S1);
    // SAFETY: a foreign pointer, passed on to the driver (absent here).
    let _ = unsafe { cuMemFree_v2(0xdead_0000) };
    assert_eq!(route::forwarded_stats().frees, f0.frees + 2);
    // Zero bytes: the driver's answer, even inside a route.
    {
        let _r = route::route(&pool, Tag::Scratch).unwrap();
        let _ = alloc(0, S1);
        assert_eq!(route::stats(&pool).unwrap().pool_allocations, 0);
    }
    // A default pool takes what no route takes; synchronous calls too.
    route::set_default(DefaultRoute::Pool(pool.clone(), Tag::named("unrouted"))).unwrap();
    let q = alloc(4096, S1).unwrap();
    let mut r: CUdeviceptr = 0;
    // SAFETY: valid out-pointer.
    assert_eq!(
        unsafe { cuMemAlloc_v2(&mut r, 8192) },
        CUresult::CUDA_SUCCESS
    );
    touch(r, 8192, 7);
    let st = route::stats(&pool).unwrap();
    assert_eq!(st.tag(&Tag::named("unrouted")).unwrap().live_blocks, 2);
    assert_eq!(free(q, S1), CUresult::CUDA_SUCCESS);
    // SAFETY: a routed block.
    assert_eq!(unsafe { cuMemFree_v2(r) }, CUresult::CUDA_SUCCESS);
    route::set_default(DefaultRoute::Driver).unwrap();
    assert!(alloc(4096, S1).is_err());
    route::flush(&pool);
    assert_eq!(pool.stats().in_use, 0);
}

#[test]
fn unregistering_gives_cached_blocks_back() {
    let _s = SERIAL.lock();
    let b: Arc<dyn Backend> = Arc::new(HostBackend::new(2 << 20).unwrap());
    let shared = SharedPool::new(b, SharedPoolConfig::new().global_limit(256 << 20)).unwrap();
    let m = shared
        .register(ModelConfig::new("gone", 1 << 30, 64 << 20))
        .unwrap();
    let live = {
        let _r = route::route(&m, Tag::Kv).unwrap();
        let cached = alloc(8 << 20, S1).unwrap();
        let live = alloc(4 << 20, S1).unwrap();
        assert_eq!(free(cached, S1), CUresult::CUDA_SUCCESS);
        live
    };
    drop(m);
    // The live block is still usable and charged; the cached one is given back at unregister.
    touch(live, 4 << 20, 9);
    assert_eq!(free(live, S1), CUresult::CUDA_SUCCESS);
    shared.unregister("gone").unwrap();
    assert_eq!(shared.stats().global.used, 0);
}

/// Many threads allocate on their per-thread streams and hand blocks to other threads to
/// free; every block carries its owner's pattern, so memory handed out twice shows.
#[test]
fn concurrent_allocate_and_cross_thread_free() {
    let _s = SERIAL.lock();
    let pool = host_pool("concurrent");
    route::set_stream_cache_limit(&pool, 8 << 20); // fence often: exercise every path
    const THREADS: usize = 8;
    const ROUNDS: usize = 300;
    /// Blocks handed to a thread to check and free: address, bytes written, pattern.
    type Inbox = Mutex<Vec<(u64, usize, u8)>>;
    let inbox: Arc<Vec<Inbox>> = Arc::new((0..THREADS).map(|_| Mutex::new(Vec::new())).collect());
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (pool, inbox, barrier) = (pool.clone(), inbox.clone(), barrier.clone());
            std::thread::spawn(move || {
                let _r = route::route(&pool, Tag::Activations).unwrap();
                barrier.wait();
                let mut seen = HashSet::new();
                for i in 0..ROUNDS {
                    let bytes = 512 + (i * 7919 + t * 104729) % (3 << 20);
                    let seed = (t * 31 + i) as u8;
                    let p = alloc(bytes, PER_THREAD).unwrap();
                    touch(p, bytes.min(4096), seed);
                    seen.insert(p);
                    inbox[(t + 1 + i) % THREADS]
                        .lock()
                        .push((p, bytes.min(4096), seed));
                    let mine = std::mem::take(&mut *inbox[t].lock());
                    for (q, n, s) in mine {
                        // SAFETY: the block is live (only its receiver frees it) and this many
                        // bytes were written with `s`.
                        let got = unsafe { std::slice::from_raw_parts(q as *const u8, n) };
                        assert!(
                            got.iter().all(|&b| b == s),
                            "block {q:#x} overwritten while live"
                        );
                        assert_eq!(free(q, PER_THREAD), CUresult::CUDA_SUCCESS);
                    }
                }
                seen.len()
            })
        })
        .collect();
    for h in handles {
        assert!(h.join().unwrap() > 0);
    }
    for b in inbox.iter() {
        for (q, _, _) in b.lock().drain(..) {
            assert_eq!(free(q, S1), CUresult::CUDA_SUCCESS);
        }
    }
    let st = route::stats(&pool).unwrap();
    let t = st.tag(&Tag::Activations).unwrap();
    assert_eq!((t.live_blocks, t.live_bytes), (0, 0));
    assert_eq!(t.allocations, (THREADS * ROUNDS) as u64);
    assert!(st.fences > 0, "the small cache limit fenced blocks back");
    route::flush(&pool);
    assert_eq!(pool.stats().in_use, 0);
    pool.audit().unwrap();
}

#[test]
fn routing_refuses_a_dead_route_target_cleanly() {
    let _s = SERIAL.lock();
    // A route to a plain pool with a 2 MiB physical limit: what does not fit is refused,
    // nothing panics, nothing is held for the refusal.
    let b: Arc<dyn Backend> = Arc::new(HostBackend::new(2 << 20).unwrap());
    let pool = Pool::new(
        b,
        elastic_vmm::PoolConfig::new(1 << 30).physical_limit(2 << 20),
    )
    .unwrap();
    let _r = route::route(&pool, Tag::Scratch).unwrap();
    assert!(alloc(1 << 20, S1).is_ok());
    assert_eq!(alloc(4 << 20, S1), Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    let r = route::last_refusal().unwrap();
    assert_eq!(r.asked, 4 << 20);
    assert!(matches!(
        route::stats(&pool).unwrap().last_refusal,
        Some(ref x) if x.asked == 4 << 20
    ));
    assert_eq!(pool.stats().in_use, 1 << 20);
    pool.audit().unwrap();
}

#[test]
fn dropping_the_pool_gives_cached_and_later_freed_blocks_back() {
    let _s = SERIAL.lock();
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::new(2 << 20).unwrap());
    let pool = Pool::new(backend.clone(), elastic_vmm::PoolConfig::new(1 << 30)).unwrap();
    let live = {
        let _r = route::route(&pool, Tag::Kv).unwrap();
        let cached = alloc(8 << 20, S1).unwrap();
        let live = alloc(4 << 20, S1).unwrap();
        assert_eq!(free(cached, S1), CUresult::CUDA_SUCCESS);
        live
    };
    assert!(backend.physical_bytes().unwrap() >= 12 << 20);
    drop(pool);
    // The live block outlives its pool's handles and stays usable.
    touch(live, 4 << 20, 5);
    assert!(backend.physical_bytes().unwrap() >= 4 << 20);
    // Its free goes behind a fence (passed at once on the host), not into a cache: with it the
    // last allocation goes and the pool gives everything back.
    assert_eq!(free(live, S1), CUresult::CUDA_SUCCESS);
    let mut p: CUdeviceptr = 0;
    let other = host_pool("other");
    {
        // Any routed call gives back fenced blocks that have passed.
        let _r = route::route(&other, Tag::Kv).unwrap();
        // SAFETY: valid out-pointer.
        assert_eq!(
            unsafe { cuMemAllocAsync(&mut p, 512, S1 as CUstream) },
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(free(p, S1), CUresult::CUDA_SUCCESS);
    }
    assert_eq!(backend.physical_bytes().unwrap(), 0);
}

/// What one model freed through routing (cached for its own reuse) is idle memory another model
/// can get: donation measures it only after it went back to its pool.
#[test]
fn another_model_gets_what_a_model_freed_through_routing() {
    let _s = SERIAL.lock();
    let b: Arc<dyn Backend> = Arc::new(HostBackend::new(2 << 20).unwrap());
    let shared = SharedPool::new(b, SharedPoolConfig::new().global_limit(64 << 20)).unwrap();
    let a = shared
        .register(ModelConfig::new("a", 1 << 30, 64 << 20))
        .unwrap();
    let m = shared
        .register(ModelConfig::new("b", 1 << 30, 64 << 20))
        .unwrap();
    {
        let _r = route::route(&a, Tag::Kv).unwrap();
        let p = alloc(48 << 20, S1).unwrap();
        assert_eq!(free(p, S1), CUresult::CUDA_SUCCESS);
    }
    assert_eq!(route::stats(&a).unwrap().cached_bytes, 48 << 20);
    let _r = route::route(&m, Tag::Kv).unwrap();
    let q = alloc(48 << 20, S1).expect("a's freed blocks handed over");
    assert_eq!(route::stats(&a).unwrap().cached_bytes, 0);
    assert_eq!(free(q, S1), CUresult::CUDA_SUCCESS);
    route::flush(&m);
    let st = shared.stats();
    assert!(st.global.used <= 64 << 20);
    assert_eq!(st.global.in_use, 0);
}

/// Issue 22, defect 1: a pool that sleeps serves no routed allocation. Blocks freed before the
/// sleep go back to the pool (they are idle, not slept); blocks freed while it sleeps are not
/// kept for reuse (their memory is released); an allocation is refused until the pool wakes.
#[test]
fn a_sleeping_pool_serves_no_routed_allocation() {
    let _s = SERIAL.lock();
    let pool = host_pool("sleepy");
    let _r = route::route(&pool, Tag::Kv).unwrap();
    let early = alloc(4096, S1).unwrap();
    let p = alloc(4096, S1).unwrap();
    touch(p, 4096, 1);
    assert_eq!(free(early, S1), CUresult::CUDA_SUCCESS);
    pool.sleep(&SleepPolicy::discard_all()).unwrap();
    assert_eq!(route::stats(&pool).unwrap().cached_bytes, 0);
    // Freed while asleep: its memory is released, nothing may hand it out.
    assert_eq!(free(p, S1), CUresult::CUDA_SUCCESS);
    assert_eq!(
        alloc(4096, S1),
        Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        "a sleeping pool served a routed allocation (at {p:#x} before)"
    );
    let r = route::last_refusal().expect("refusal kept");
    assert!(r.reason.contains("asleep"), "{r}");
    let st = route::stats(&pool).unwrap();
    assert_eq!((st.cached_bytes, st.fenced_bytes), (0, 0), "{st:?}");
    assert_eq!(pool.stats().in_use, 0);
    // Awake again: served (mapped memory), and stream reuse works as before.
    pool.wake(AfterWake::KeepHostMemory).unwrap();
    let q = alloc(4096, S1).unwrap();
    touch(q, 4096, 2);
    assert_eq!(free(q, S1), CUresult::CUDA_SUCCESS);
    assert_eq!(alloc(4096, S1).unwrap(), q);
    assert_eq!(free(q, S1), CUresult::CUDA_SUCCESS);
    route::flush(&pool);
    assert_eq!(pool.stats().in_use, 0);
    pool.audit().unwrap();
}

/// Sleep and wake racing routed allocations and frees on several threads (unmaps slowed so
/// that sleeps spend long falling asleep while frees land): no allocation that began and ended
/// while the pool was not awake (with no wake in between) succeeds.
#[test]
fn sleep_racing_routed_allocations_serves_nothing_while_not_awake() {
    let _s = SERIAL.lock();
    let delay = Arc::new(DelayInjector::new(Arc::new(
        HostBackend::new(2 << 20).unwrap(),
    )));
    delay.set(DriverCall::Unmap, Delay::new(Duration::from_millis(1)));
    let pool = Pool::new(
        delay.clone(),
        elastic_vmm::PoolConfig::new(1 << 30).name("race"),
    )
    .unwrap();
    const THREADS: usize = 4;
    const ROUNDS: usize = 25;
    let stop = Arc::new(AtomicBool::new(false));
    let served_asleep = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (pool, stop, served, barrier) = (
                pool.clone(),
                stop.clone(),
                served_asleep.clone(),
                barrier.clone(),
            );
            std::thread::spawn(move || {
                let _r = route::route(&pool, Tag::Activations).unwrap();
                let not_awake = |s: SleepStatus| s != SleepStatus::Awake;
                let mut held: Vec<u64> = Vec::new();
                let mut tries = 0u64;
                barrier.wait();
                let mut i = t;
                while !stop.load(Ordering::Acquire) {
                    i += 1;
                    let before = pool.sleep_stats();
                    let got = alloc(4096 << (i % 3), PER_THREAD);
                    let after = pool.sleep_stats();
                    tries += 1;
                    if let Ok(p) = got {
                        if not_awake(before.status)
                            && not_awake(after.status)
                            && before.wakes == after.wakes
                        {
                            served.fetch_add(1, Ordering::Relaxed);
                        }
                        held.push(p);
                    }
                    // Keep a few blocks live across sleeps; free the oldest.
                    if held.len() > 3 || (got.is_err() && !held.is_empty()) {
                        assert_eq!(free(held.remove(0), PER_THREAD), CUresult::CUDA_SUCCESS);
                    }
                }
                for p in held {
                    assert_eq!(free(p, PER_THREAD), CUresult::CUDA_SUCCESS);
                }
                tries
            })
        })
        .collect();
    barrier.wait();
    for _ in 0..ROUNDS {
        std::thread::sleep(Duration::from_millis(2));
        pool.sleep(&SleepPolicy::discard_all()).unwrap();
        std::thread::sleep(Duration::from_millis(3));
        pool.wake(AfterWake::KeepHostMemory).unwrap();
    }
    stop.store(true, Ordering::Release);
    for w in workers {
        assert!(w.join().unwrap() > 0);
    }
    assert_eq!(
        served_asleep.load(Ordering::Relaxed),
        0,
        "routed allocations were served while the pool was not awake"
    );
    route::flush(&pool);
    assert_eq!(pool.stats().in_use, 0);
    pool.audit().unwrap();
}

/// A synchronous allocation may be used on any stream at once: it never gets a block freed on
/// a stream (which only that stream may reuse before a fence).
#[test]
fn synchronous_allocations_never_take_stream_cached_blocks() {
    let _s = SERIAL.lock();
    let pool = host_pool("sync");
    let _r = route::route(&pool, Tag::Scratch).unwrap();
    let p = alloc(8192, 0x1).unwrap();
    assert_eq!(free(p, 0x1), CUresult::CUDA_SUCCESS);
    let mut q: CUdeviceptr = 0;
    // SAFETY: valid out-pointer.
    assert_eq!(
        unsafe { cuMemAlloc_v2(&mut q, 8192) },
        CUresult::CUDA_SUCCESS
    );
    assert_ne!(q, p);
    // SAFETY: a routed block.
    assert_eq!(unsafe { cuMemFree_v2(q) }, CUresult::CUDA_SUCCESS);
    route::flush(&pool);
}

/// `cuMemFree` waits for the whole device, so a block freed with it may be in use on any
/// stream until then, a non-blocking one included (which the legacy stream does not wait
/// for): it is not kept for reuse on one stream, it goes back to the pool once every stream of
/// its context is done (at once on the host, where nothing is queued).
#[test]
fn a_synchronous_free_is_not_kept_for_stream_reuse() {
    let _s = SERIAL.lock();
    let pool = host_pool("sync-free");
    let _r = route::route(&pool, Tag::Scratch).unwrap();
    let mut p: CUdeviceptr = 0;
    // SAFETY: valid out-pointer.
    assert_eq!(
        unsafe { cuMemAlloc_v2(&mut p, 8192) },
        CUresult::CUDA_SUCCESS
    );
    touch(p, 8192, 3);
    // SAFETY: a routed block.
    assert_eq!(unsafe { cuMemFree_v2(p) }, CUresult::CUDA_SUCCESS);
    let st = route::stats(&pool).unwrap();
    assert_eq!(
        (st.cached_bytes, st.fenced_bytes),
        (0, 0),
        "a synchronous free was kept for reuse on the legacy stream: {st:?}"
    );
    assert_eq!(pool.stats().in_use, 0);
    // Its memory is the pool's again: a later allocation on any stream may get it.
    let q = alloc(8192, S2).unwrap();
    touch(q, 8192, 4);
    assert_eq!(free(q, S2), CUresult::CUDA_SUCCESS);
    route::flush(&pool);
    pool.audit().unwrap();
}

/// Issue 33, defect 13: the books hold while two routed models race limit changes, trims,
/// flushes and a third model's register/unregister, with blocks freed on other threads and
/// streams. An auditor checks the ledger against every pool and the backend all the while; a
/// delaying backend (150 us per create, map, unmap and release) widens every window.
///
/// It failed once in about 30 runs on main 23eee55 (`audit 701273: ledger says 167772160 bytes
/// (a 54525952, b 92274688, c 20971520; leaked 0), backend holds only 166502400`: 1269760 bytes
/// short, not a whole chunk, with nothing in flight): the audit read the backend after
/// releasing the pools' locks, while a release that started meanwhile punched its chunks (the
/// deterministic test is `shared::tests::a_release_starting_during_an_audit_...`). With the
/// fix, 35 runs of it passed. Bounded (3 s), so it runs with the suite: one run on a loaded
/// 2-core machine may miss the window, but every run that hits it fails.
#[test]
fn the_books_hold_while_routed_models_race_limits_trims_flushes_and_unregister() {
    let _s = SERIAL.lock();
    let host: Arc<dyn Backend> = Arc::new(HostBackend::new(2 << 20).unwrap());
    let injector = Arc::new(DelayInjector::new(host));
    let backend: Arc<dyn Backend> = injector.clone();
    let shared = SharedPool::new(backend, SharedPoolConfig::new().global_limit(160 << 20)).unwrap();
    let models: Vec<_> = ["a", "b"]
        .iter()
        .map(|id| {
            let m = shared
                .register(ModelConfig::new(*id, 1 << 30, 96 << 20))
                .unwrap();
            route::set_stream_cache_limit(&m, 6 << 20);
            m
        })
        .collect();
    for call in [
        DriverCall::Create,
        DriverCall::Map,
        DriverCall::Unmap,
        DriverCall::Release,
    ] {
        injector.set_delay(call, Duration::from_micros(150));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let failure: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
    let mut threads = Vec::new();
    // Two workers per model: allocate on their own stream, hand blocks to the other to free.
    type Inboxes = Arc<[Mutex<Vec<u64>>; 2]>;
    let mut inboxes: Vec<Inboxes> = Vec::new();
    for (mi, m) in models.iter().enumerate() {
        let inbox: Inboxes = Arc::new([Mutex::default(), Mutex::default()]);
        inboxes.push(inbox.clone());
        for w in 0..2usize {
            let (m, inbox, stop) = (m.clone(), inbox.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let stream = 0x100 * (mi + 1) + w;
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let bytes = (64 << 10) + (i * 7919 + w * 104729) % (5 << 20);
                    let got = route::with_route(&m, Tag::Activations, || alloc(bytes, stream));
                    if let Ok(Ok(p)) = got {
                        inbox[1 - w].lock().push(p);
                    }
                    let mine = std::mem::take(&mut *inbox[w].lock());
                    for p in mine {
                        assert_eq!(free(p, stream), CUresult::CUDA_SUCCESS);
                    }
                }
            }));
        }
    }
    // Limits up and down, trims and flushes.
    {
        let (shared, models, stop) = (shared.clone(), models.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                for (k, m) in models.iter().enumerate() {
                    let limit = (16 + (i * 13 + k as u64 * 29) % 96) << 20;
                    let _ = shared.set_limit(m.id(), limit);
                    if i % 3 == 0 {
                        let _ = m.trim();
                    }
                    if i % 2 == k as u64 {
                        route::flush(m);
                    }
                }
            }
        }));
    }
    // A third model comes and goes, routed, under the same global limit: one thread allocates
    // through it (registering it again when it is gone), another unregisters it at any moment.
    {
        let (shared, stop) = (shared.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let c = match shared.model("c") {
                    Ok(c) => c,
                    Err(_) => match shared.register(ModelConfig::new("c", 1 << 30, 32 << 20)) {
                        Ok(c) => c,
                        Err(_) => continue,
                    },
                };
                let blocks: Vec<u64> = (0..4)
                    .filter_map(|k| {
                        i += 1;
                        route::with_route(&c, Tag::Kv, || alloc((1 + (i + k) % 3) << 20, 0x900))
                            .ok()
                            .and_then(Result::ok)
                    })
                    .collect();
                for p in blocks {
                    assert_eq!(free(p, 0x901 + i % 2), CUresult::CUDA_SUCCESS);
                }
                if i % 3 == 0 {
                    route::flush(&c);
                }
            }
        }));
    }
    {
        let (shared, stop) = (shared.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(c) = shared.model("c") {
                    if let Some(r) = route::stats(&c) {
                        if r.cached_bytes > 0 {
                            route::flush(&c);
                        }
                    }
                }
                let _ = shared.unregister("c");
                std::thread::sleep(Duration::from_micros(300));
            }
        }));
    }
    // The auditor.
    {
        let (shared, stop, failure) = (shared.clone(), stop.clone(), failure.clone());
        threads.push(std::thread::spawn(move || {
            let mut audits = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if let Err(e) = shared.audit() {
                    *failure.lock() = Some(format!("audit {audits}: {e}"));
                    stop.store(true, Ordering::Relaxed);
                }
                audits += 1;
            }
            assert!(audits > 0);
        }));
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while !stop.load(Ordering::Relaxed) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    if let Some(f) = failure.lock().take() {
        panic!("the books drifted: {f}");
    }
    // Blocks still in an inbox when their receiver stopped.
    for inbox in &inboxes {
        for b in inbox.iter() {
            for p in std::mem::take(&mut *b.lock()) {
                assert_eq!(free(p, 0x77), CUresult::CUDA_SUCCESS);
            }
        }
    }
    injector.clear();
    for m in models.iter().cloned().chain(shared.model("c").ok()) {
        route::flush(&m);
    }
    shared.audit().unwrap();
    let st = shared.stats();
    assert_eq!(st.global.in_use, 0, "{st:?}");
}
