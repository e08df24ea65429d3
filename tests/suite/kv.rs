//! The paged KV cache ([`elastic_vmm::kv::PagedKv`]), generic over the backend (host in CI,
//! CUDA on the GPU): the allocator, the zero page, limits, look-ahead watermarks, and races with
//! reclaim and sleep.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};

use elastic_vmm::backend::testing::{DelayInjector, FaultInjector};
use elastic_vmm::kv::{KvLayout, PagedKv, PagedKvConfig, Watermarks};
use elastic_vmm::{
    AfterWake, Backend, DriverCall, Error, MemOptions, ModelConfig, Pool, PoolConfig, SharedPool,
    SharedPoolConfig, SleepAction, SleepPolicy, Tag,
};

use super::Rng;

/// Two heads of 64 elements of 2 bytes: 256 bytes per token.
const TOKEN_BYTES: u64 = 256;

/// A per-layer config with `per_page` blocks in each page of each tensor.
fn config(g: u64, per_page: u64, layers: usize, max_blocks: usize) -> PagedKvConfig {
    PagedKvConfig::new(
        layers,
        2,
        64,
        (g / per_page / TOKEN_BYTES) as usize,
        2,
        max_blocks,
    )
}

fn pool(backend: &Arc<dyn Backend>, capacity: u64) -> Pool {
    Pool::new(
        backend.clone(),
        PoolConfig::new(capacity as usize).growth_divisor(0),
    )
    .expect("pool")
}

fn gran(backend: &Arc<dyn Backend>) -> u64 {
    backend.info().granularity as u64
}

/// Read `len` bytes at `addr` (mapped, or aliased to the zero page).
fn read(backend: &Arc<dyn Backend>, addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0xEEu8; len];
    // SAFETY: the tests only read memory of live caches, mapped or zero-aliased.
    unsafe { backend.copies().read(addr, &mut out) }.expect("read");
    out
}

fn write(backend: &Arc<dyn Backend>, addr: u64, data: &[u8]) {
    // SAFETY: the tests only write blocks they allocated, which nothing else uses.
    unsafe { backend.copies().write(addr, data) }.expect("write");
}

/// The pool's books are whole and the backend holds what the pool says (zero page included).
fn books_hold(backend: &Arc<dyn Backend>, p: &Pool) {
    p.audit().expect("audit");
    let s = p.stats();
    assert_eq!(
        backend.physical_bytes().expect("physical"),
        s.mapped + s.cached + s.zero_page,
        "backend holds what the pool says: {s:?}"
    );
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `alloc` maps the pages under new blocks in every tensor at once, blocks on a page mapped
/// already cost nothing, `free` unmaps pages no block uses, and nothing is mapped at the start.
pub fn kv_alloc_maps_every_tensor(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let p = pool(&backend, 256 * g);
    // 2 layers: 4 tensors; 4 blocks per page; 32 blocks: 8 pages per tensor.
    let kv = PagedKv::new(&p, config(g, 4, 2, 32)).expect("cache");
    assert_eq!(kv.tensors(), 4);
    assert_eq!(kv.block_span_bytes(), g / 4);
    assert_eq!(p.stats().mapped, 0, "nothing mapped before an alloc");
    assert_eq!(kv.stats().mapped_bytes, 0);
    let maps = p.stats().driver_calls.get(DriverCall::Map);
    let a = kv.alloc(1).expect("alloc 1");
    assert_eq!(a, vec![0]);
    assert_eq!(p.stats().mapped, 4 * g, "one page in each of the 4 tensors");
    assert_eq!(
        p.stats().driver_calls.get(DriverCall::Map) - maps,
        4,
        "one map per page"
    );
    let b = kv.alloc(3).expect("alloc 3");
    assert_eq!(b, vec![1, 2, 3], "blocks on the mapped page first");
    assert_eq!(p.stats().mapped, 4 * g, "they cost no memory");
    let c = kv.alloc(1).expect("alloc 1 more");
    assert_eq!(c, vec![4]);
    assert_eq!(p.stats().mapped, 8 * g);
    assert_eq!(kv.stats().live, 5);
    assert!(kv.is_live(4) && !kv.is_live(5));
    // Data written into a block's span of each tensor stays there.
    for t in 0..kv.tensors() {
        let at = kv.tensor_addr(t).expect("tensor") + 4 * kv.block_span_bytes();
        write(&backend, at, &[t as u8 + 1; 64]);
    }
    for t in 0..kv.tensors() {
        let at = kv.tensor_addr(t).expect("tensor") + 4 * kv.block_span_bytes();
        assert_eq!(read(&backend, at, 64), vec![t as u8 + 1; 64]);
    }
    kv.free(&c).expect("free");
    assert_eq!(p.stats().mapped, 4 * g, "the page no block uses went back");
    kv.free(&a).expect("free");
    assert_eq!(p.stats().mapped, 4 * g, "blocks 1..3 still hold their page");
    kv.free(&b).expect("free");
    assert_eq!(p.stats().mapped, 0);
    assert_eq!(kv.stats().live, 0);
    books_hold(&backend, &p);
    drop(kv);
    assert_eq!(p.stats().reserved_regions, 0, "the region went back");
    assert_eq!(p.stats().zero_aliased, 0, "no alias is left");
    books_hold(&backend, &p);
}

/// Blocks nobody allocated read zeros (aliases of one zero page per pool, no memory of their
/// own), the contiguous layout maps one span per block, and allocated blocks replace the
/// aliases.
pub fn kv_unbacked_blocks_read_zeros(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let p = pool(&backend, 256 * g);
    let kv = PagedKv::new(&p, config(g, 2, 2, 16)).expect("cache");
    let s = p.stats();
    assert_eq!(s.zero_page, g, "one zero page");
    assert_eq!(
        s.zero_aliased,
        4 * 8 * g,
        "every page of 4 tensors of 8 pages aliased"
    );
    assert_eq!(s.mapped, 0, "aliases are not memory");
    let ids = kv.alloc(1).expect("alloc");
    let t1 = kv.tensor_addr(1).expect("tensor 1");
    write(&backend, t1, &[7u8; 4096]);
    // Block 5 (page 2) is not allocated: zeros, wherever in the tensors.
    for t in 0..4 {
        let at = kv.tensor_addr(t).expect("tensor") + 5 * kv.block_span_bytes();
        assert!(
            read(&backend, at, 4096).iter().all(|&b| b == 0),
            "zeros in tensor {t}"
        );
    }
    assert_eq!(read(&backend, t1, 4096), vec![7u8; 4096]);
    assert_eq!(
        p.stats().zero_aliased,
        4 * 7 * g,
        "the allocated page left the aliases"
    );
    // A second cache on the same pool shares the zero page.
    let creates = p.stats().driver_calls.get(DriverCall::Create);
    let other = PagedKv::new(&p, config(g, 2, 1, 4).layout(KvLayout::Contiguous)).expect("cache");
    assert_eq!(other.tensors(), 1);
    assert_eq!(
        other.block_span_bytes(),
        2 * g / 2,
        "a block: K and V of its one layer"
    );
    assert_eq!(p.stats().zero_page, g, "still one zero page");
    assert_eq!(
        p.stats().driver_calls.get(DriverCall::Create),
        creates,
        "not made twice"
    );
    let o = other.alloc(2).expect("alloc");
    assert_eq!(
        p.stats().mapped,
        4 * g + 2 * g,
        "each contiguous block is one page here"
    );
    other.free(&o).expect("free");
    kv.free(&ids).expect("free");
    assert_eq!(p.stats().mapped, 0);
    assert!(
        read(&backend, t1, 4096).iter().all(|&b| b == 0),
        "freed: zeros again"
    );
    books_hold(&backend, &p);
    drop((kv, other));
    books_hold(&backend, &p);
    assert_eq!(p.stats().zero_aliased, 0);
}

/// A backend that cannot map read-only is refused with its reason, and nothing is left.
pub fn kv_read_only_refusal_leaves_nothing(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let faults = Arc::new(FaultInjector::new(backend.clone()));
    let b: Arc<dyn Backend> = faults.clone();
    let p = pool(&b, 64 * g);
    // The zero page's own clearing grants read-write (call 1); every read-only grant fails.
    faults.fail_from(DriverCall::SetAccess, 2);
    let e = PagedKv::new(&p, config(g, 2, 1, 8)).expect_err("refused");
    assert!(e.to_string().contains("FAULT_INJECTED"), "{e}");
    faults.clear();
    let s = p.stats();
    assert_eq!(
        (s.mapped, s.reserved_regions, s.zero_aliased),
        (0, 0, 0),
        "{s:?}"
    );
    p.audit().expect("audit");
}

/// Bad shapes, ids and counts are errors with the numbers, and change nothing.
pub fn kv_bad_input_changes_nothing(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let p = pool(&backend, 64 * g);
    let zero = PagedKvConfig::new(2, 0, 64, 16, 2, 8);
    let e = PagedKv::new(&p, zero).expect_err("zero heads");
    assert!(e.to_string().contains("kv_heads is 0"), "{e}");
    let huge = PagedKvConfig::new(1 << 20, 1 << 20, 1 << 20, 1 << 20, 8, 1 << 30);
    let e = PagedKv::new(&p, huge).expect_err("overflow");
    assert!(matches!(e, Error::SizeOverflow { .. }), "{e}");
    let big = config(g, 1, 1, 1000);
    let e = PagedKv::new(&p, big).expect_err("more than the reservation");
    assert!(matches!(e, Error::OutOfAddressSpace { .. }), "{e}");
    let w = config(g, 2, 1, 8).watermarks(Watermarks::new(5, 3));
    let e = PagedKv::new(&p, w).expect_err("low above high");
    assert!(e.to_string().contains("low 5 high 3"), "{e}");
    assert_eq!(
        p.stats().reserved_regions,
        0,
        "nothing reserved by refusals"
    );

    let kv = PagedKv::new(&p, config(g, 2, 1, 8)).expect("cache");
    let ids = kv.alloc(3).expect("alloc");
    let before = (p.stats().mapped, kv.stats());
    let e = kv.alloc(6).expect_err("too many");
    assert!(
        matches!(
            e,
            Error::KvOutOfBlocks {
                requested: 6,
                free: 5,
                max_blocks: 8
            }
        ),
        "{e}"
    );
    let e = kv.free(&[ids[0], 8]).expect_err("out of range");
    assert!(
        matches!(
            e,
            Error::KvBadBlock {
                block: 8,
                max_blocks: 8,
                ..
            }
        ),
        "{e}"
    );
    let e = kv.free(&[ids[1], ids[1]]).expect_err("repeated");
    assert!(e.to_string().contains("named twice"), "{e}");
    let e = kv.free(&[5]).expect_err("never allocated");
    assert!(e.to_string().contains("not allocated"), "{e}");
    assert_eq!((p.stats().mapped, kv.stats()), before, "nothing changed");
    assert!(ids.iter().all(|&b| kv.is_live(b)));
    kv.free(&ids).expect("free");
    let e = kv.free(&ids[..1]).expect_err("double free");
    assert!(e.to_string().contains("freed twice"), "{e}");
    assert_eq!(kv.alloc(0).expect("none"), Vec::<usize>::new());
    books_hold(&backend, &p);
}

/// `available` follows the pool's limit; an alloc over it fails and leaves nothing mapped or
/// charged; within it, it succeeds.
pub fn kv_limits_and_available(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    // 1 layer (2 tensors), 2 blocks per page: a fresh pair of blocks costs 2 pages. The zero
    // page is charged: one granule of the limit.
    let p = Pool::new(
        backend.clone(),
        PoolConfig::new(64 * g as usize).physical_limit(7 * g),
    )
    .expect("pool");
    let kv = PagedKv::new(&p, config(g, 2, 1, 16)).expect("cache");
    assert_eq!(kv.available(), 6, "3 page pairs of 2 blocks");
    let a = kv.alloc(5).expect("alloc 5");
    assert_eq!(p.stats().mapped, 6 * g);
    assert_eq!(kv.available(), 1, "the other half of the last page");
    let before = p.stats();
    let e = kv.alloc(2).expect_err("over the limit");
    assert!(e.is_out_of_memory(), "{e}");
    let after = p.stats();
    assert_eq!(
        (after.mapped, after.cached, after.in_flight),
        (before.mapped, before.cached, 0)
    );
    assert_eq!(kv.stats().live, 5, "nothing allocated");
    let b = kv.alloc(1).expect("the free half");
    kv.free(&a).expect("free");
    kv.free(&b).expect("free");
    books_hold(&backend, &p);
}

/// With watermarks, steady-state alloc/free of 1, 16 and 64 blocks makes no driver call.
pub fn kv_warm_blocks_make_no_driver_calls(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let p = pool(&backend, 512 * g);
    let w = Watermarks {
        low: 64,
        high: 128,
        idle_after: Duration::from_secs(60),
        tick: Duration::from_millis(5),
    };
    let kv = PagedKv::new(&p, config(g, 16, 2, 1024).watermarks(w)).expect("cache");
    wait_until("warm blocks at low", Duration::from_secs(10), || {
        kv.stats().warm >= 64
    });
    for n in [1usize, 16, 64] {
        // Settle: the thread refills to high once warm blocks fell below low. From high, an
        // alloc of up to high - low blocks never takes warm blocks below low, and the free
        // puts them back: neither the token path nor the thread makes a driver call.
        let ids = kv.alloc(n).expect("alloc");
        kv.free(&ids).expect("free");
        wait_until("refilled", Duration::from_secs(10), || {
            kv.stats().warm >= 128
        });
        let calls = p.stats().driver_calls.total();
        for _ in 0..200 {
            let ids = kv.alloc(n).expect("alloc");
            kv.free(&ids).expect("free");
        }
        assert_eq!(
            p.stats().driver_calls.total(),
            calls,
            "alloc/free of {n} blocks at steady state made driver calls"
        );
    }
    drop(kv);
    books_hold(&backend, &p);
}

/// kvcached #336: the look-ahead thread takes at most `high` blocks before the first request,
/// never the free memory at large; and it takes nothing another model holds idle.
pub fn kv_ahead_takes_only_its_high_watermark(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let shared = SharedPool::new(
        backend.clone(),
        SharedPoolConfig::new().global_limit(24 * g),
    )
    .expect("shared");
    let a = shared
        .register(ModelConfig::new("a", (64 * g) as usize, 24 * g))
        .expect("a");
    // Model a holds 12 granules idle (allocated and freed: mapped, not in use).
    drop(a.allocate((12 * g) as usize).expect("a allocates"));
    let a_idle = a.stats().mapped;
    assert!(a_idle >= 12 * g);
    let b = shared
        .register(ModelConfig::new("b", (256 * g) as usize, 24 * g))
        .expect("b");
    // 1 layer, 1 block per page: each warm block is 2 pages. high 64 would be 128 pages.
    let w = Watermarks {
        low: 64,
        high: 64,
        idle_after: Duration::from_secs(60),
        tick: Duration::from_millis(2),
    };
    let kv = PagedKv::new(&b, config(g, 1, 1, 100).watermarks(w)).expect("cache");
    // Whatever the thread manages, it settles: wait for it to try a few times.
    wait_until(
        "look-ahead refused at the budget",
        Duration::from_secs(10),
        || kv.stats().ahead_refused >= 3,
    );
    let s = kv.stats();
    assert!(s.warm <= 64, "{s:?}");
    assert_eq!(
        a.stats().mapped,
        a_idle,
        "model a's idle memory was not taken"
    );
    assert!(
        b.stats().mapped <= 12 * g,
        "b took only the free budget: {} mapped",
        b.stats().mapped
    );
    // A required alloc may reclaim a's idle memory.
    // Beyond the warm blocks, 5 fresh ones (10 granules): within b's limit, more than the
    // budget's free part once b's look-ahead took it (12 granules: b's zero page, and 5 blocks
    // of 2 pages).
    assert_eq!(
        b.stats().mapped,
        10 * g,
        "b's look-ahead took the free budget"
    );
    assert_eq!(b.stats().zero_page, g);
    let ids = kv.alloc(s.warm + 5).expect("required growth");
    assert!(
        a.stats().mapped < a_idle,
        "a gave its idle memory for a required alloc"
    );
    kv.free(&ids).expect("free");
    drop(kv);
    drop((a, b));
}

/// kvcached #339/#341: no start-up race between the look-ahead thread and the first allocs:
/// every id handed out once, the books whole, over many rounds with slow driver calls.
pub fn kv_no_startup_race(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let slow = Arc::new(DelayInjector::new(backend.clone()));
    slow.set_delay(DriverCall::Map, Duration::from_micros(200));
    let b: Arc<dyn Backend> = slow.clone();
    let p = pool(&b, 256 * g);
    for round in 0..20 {
        let w = Watermarks {
            low: 4,
            high: 8,
            idle_after: Duration::from_millis(5),
            tick: Duration::from_millis(1),
        };
        let kv = Arc::new(PagedKv::new(&p, config(g, 2, 1, 64).watermarks(w)).expect("cache"));
        let go = Arc::new(Barrier::new(4));
        let got: Vec<Vec<usize>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    let (kv, go) = (kv.clone(), go.clone());
                    s.spawn(move || {
                        go.wait();
                        let mut mine = Vec::new();
                        for _ in 0..4 {
                            mine.extend(kv.alloc(2).expect("alloc"));
                        }
                        mine
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        let mut all: Vec<usize> = got.concat();
        all.sort_unstable();
        let n = all.len();
        all.dedup();
        assert_eq!(all.len(), n, "round {round}: an id was handed out twice");
        assert_eq!(kv.stats().live, n);
        kv.free(&all).expect("free");
        drop(kv);
        p.audit().expect("audit");
    }
    slow.clear();
    books_hold(&b, &p);
}

/// PR #319's review: after a spike, the cache is back at its idle floor within a bounded time.
pub fn kv_memory_comes_back_after_a_spike(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let p = pool(&backend, 512 * g);
    let w = Watermarks {
        low: 4,
        high: 32,
        idle_after: Duration::from_millis(100),
        tick: Duration::from_millis(5),
    };
    // 1 layer, 4 blocks per page: a page pair holds 4 blocks.
    let kv = PagedKv::new(&p, config(g, 4, 1, 512).watermarks(w)).expect("cache");
    let mut rng = Rng::new(7);
    let spike = kv.alloc(400).expect("spike");
    // Keep a scattered tenth of them live, free the rest.
    let (keep, gone): (Vec<usize>, Vec<usize>) =
        spike.into_iter().partition(|_| rng.below(10) == 0);
    kv.free(&gone).expect("free");
    let start = Instant::now();
    // Floor: the live blocks' pages (scattered: at most one page pair each) plus low warm ones.
    let pair = 2 * g;
    let bound = (keep.len() as u64 + 4) * pair;
    wait_until("back at the idle floor", Duration::from_secs(5), || {
        kv.stats().warm <= 4 && p.stats().mapped <= bound
    });
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    let s = kv.stats();
    assert_eq!(s.live, keep.len());
    assert!(s.warm_returned > 0, "{s:?}");
    // New allocs go to the pages live blocks keep mapped first: refill the holes, no growth.
    let before = p.stats().mapped;
    let holes = kv.alloc(keep.len()).expect("alloc");
    assert!(
        p.stats().mapped <= before,
        "filled pages already mapped first"
    );
    kv.free(&holes).expect("free");
    kv.free(&keep).expect("free");
    drop(kv);
    books_hold(&backend, &p);
}

/// Sleep discards the KV (its memory goes), keeps weights, refuses allocs while asleep, and
/// wakes the blocks at the same addresses, usable again.
pub fn kv_sleep_discards_kv_keeps_weights(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let p = pool(&backend, 256 * g);
    let weights = p
        .allocate_with((4 * g) as usize, &MemOptions::new().tag(Tag::Weights))
        .expect("weights");
    let kv = PagedKv::new(&p, config(g, 2, 1, 16)).expect("cache");
    let ids = kv.alloc(4).expect("alloc");
    let addr = kv.tensor_addr(0).expect("tensor");
    let policy = SleepPolicy::offload_all().tag(Tag::Kv, SleepAction::Discard);
    p.sleep(&policy).expect("sleep");
    assert_eq!(p.stats().mapped, 0, "everything asleep");
    let e = kv.alloc(1).expect_err("asleep");
    assert!(matches!(e, Error::Asleep { .. }), "{e}");
    p.wake(AfterWake::FreeHostMemory).expect("wake");
    assert_eq!(kv.tensor_addr(0), Some(addr), "same addresses");
    assert_eq!(
        p.stats().mapped,
        4 * g + 4 * g,
        "weights and the 2 page pairs back"
    );
    write(&backend, addr, &[9u8; 128]);
    assert_eq!(read(&backend, addr, 128), vec![9u8; 128]);
    let more = kv.alloc(2).expect("alloc after wake");
    kv.free(&more).expect("free");
    kv.free(&ids).expect("free");
    drop((kv, weights));
    books_hold(&backend, &p);
}

/// The engine side of the reclaim test: its cache and the blocks its sequences hold.
type Engine = (Arc<PagedKv>, parking_lot::Mutex<Vec<usize>>);

/// A model's reclaim callback frees blocks (and trims warm ones): lowering its limit succeeds
/// and the memory goes back.
pub fn kv_reclaim_callback_frees_blocks(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let shared = SharedPool::new(backend.clone(), SharedPoolConfig::new()).expect("shared");
    let slot: Arc<OnceLock<Engine>> = Arc::new(OnceLock::new());
    let cb = slot.clone();
    let asked = Arc::new(AtomicUsize::new(0));
    let asked2 = asked.clone();
    let m = shared
        .register(
            ModelConfig::new("m", (256 * g) as usize, 64 * g).on_reclaim(move |bytes| {
                asked2.fetch_add(1, Ordering::SeqCst);
                if let Some((kv, live)) = cb.get() {
                    // Evict the newest sequences' blocks: 2 blocks per page pair.
                    let n = (bytes.div_ceil(2 * g) * 2) as usize;
                    let mut live = live.lock();
                    let cut = live.len().saturating_sub(n);
                    let gone: Vec<usize> = live.drain(cut..).collect();
                    kv.free(&gone).expect("free in reclaim");
                    kv.trim();
                }
            }),
        )
        .expect("model");
    let w = Watermarks {
        low: 2,
        high: 4,
        idle_after: Duration::from_secs(60),
        tick: Duration::from_millis(5),
    };
    let kv = Arc::new(PagedKv::new(&m, config(g, 2, 1, 64).watermarks(w)).expect("cache"));
    let ids = kv.alloc(20).expect("alloc");
    if slot
        .set((kv.clone(), parking_lot::Mutex::new(ids)))
        .is_err()
    {
        panic!("the slot is set once");
    }
    assert!(m.stats().mapped >= 20 * g);
    shared.set_limit("m", 10 * g).expect("limit lowered");
    assert!(asked.load(Ordering::SeqCst) > 0, "the callback was asked");
    let used = shared
        .model("m")
        .expect("m")
        .model_stats()
        .expect("stats")
        .used;
    assert!(used <= 10 * g, "used {used}");
    let live = slot.get().expect("slot").1.lock().clone();
    assert_eq!(kv.stats().live, live.len());
    kv.free(&live).expect("free");
}

/// Races: allocs and frees on several threads against reclaim-style trims and sleep/wake of
/// the pool, with slow maps and unmaps. Every id is live once, and at the end everything goes
/// back.
pub fn kv_races_alloc_free_trim_sleep(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let slow = Arc::new(DelayInjector::new(backend.clone()));
    slow.set_delay(DriverCall::Map, Duration::from_micros(100));
    slow.set_delay(DriverCall::Unmap, Duration::from_micros(100));
    let b: Arc<dyn Backend> = slow.clone();
    let p = pool(&b, 512 * g);
    let w = Watermarks {
        low: 4,
        high: 16,
        idle_after: Duration::from_millis(10),
        tick: Duration::from_millis(1),
    };
    let kv = Arc::new(PagedKv::new(&p, config(g, 4, 2, 256).watermarks(w)).expect("cache"));
    let stop = Arc::new(AtomicBool::new(false));
    let owner: Arc<Vec<AtomicUsize>> = Arc::new((0..256).map(|_| AtomicUsize::new(0)).collect());
    std::thread::scope(|s| {
        for t in 1..=3usize {
            let (kv, stop, owner) = (kv.clone(), stop.clone(), owner.clone());
            s.spawn(move || {
                let mut rng = Rng::new(t as u64);
                let mut mine: Vec<usize> = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    if mine.len() < 40 && rng.below(2) == 0 {
                        match kv.alloc(1 + rng.below(8) as usize) {
                            Ok(ids) => {
                                for &i in &ids {
                                    let prev = owner[i].swap(t, Ordering::SeqCst);
                                    assert_eq!(
                                        prev, 0,
                                        "block {i} handed to {t} while {prev} has it"
                                    );
                                }
                                mine.extend(ids);
                            }
                            Err(Error::Asleep { .. }) | Err(Error::KvOutOfBlocks { .. }) => {}
                            Err(e) => panic!("alloc: {e}"),
                        }
                    } else if !mine.is_empty() {
                        let n = 1 + rng.below(mine.len() as u64) as usize;
                        let gone: Vec<usize> = mine.drain(..n).collect();
                        for &i in &gone {
                            owner[i].store(0, Ordering::SeqCst);
                        }
                        kv.free(&gone).expect("free");
                    }
                }
                for &i in &mine {
                    owner[i].store(0, Ordering::SeqCst);
                }
                kv.free(&mine).expect("free at the end");
            });
        }
        let (kv2, p2, stop2) = (kv.clone(), p.clone(), stop.clone());
        s.spawn(move || {
            let policy = SleepPolicy::discard_all();
            for i in 0..20 {
                std::thread::sleep(Duration::from_millis(5));
                if i % 2 == 0 {
                    kv2.trim();
                } else if p2.sleep(&policy).is_ok() {
                    std::thread::sleep(Duration::from_millis(2));
                    p2.wake(AfterWake::KeepHostMemory).expect("wake");
                }
            }
            stop2.store(true, Ordering::Relaxed);
        });
    });
    assert_eq!(kv.stats().live, 0);
    kv.trim();
    drop(kv);
    slow.clear();
    p.trim().expect("trim");
    assert_eq!(p.stats().mapped, 0);
    books_hold(&b, &p);
}

/// Distinct bytes for block `b` of tensor `t`, the whole span.
fn block_pattern(b: usize, t: usize, len: usize) -> Vec<u8> {
    let mut r = Rng::new((b as u64) << 16 | t as u64);
    (0..len).map(|_| r.next() as u8).collect()
}

fn span_at(kv: &PagedKv, b: usize, t: usize) -> u64 {
    kv.tensor_addr(t).expect("tensor") + b as u64 * kv.block_span_bytes()
}

/// Write every tensor's span of `blocks` with [`block_pattern`].
fn fill_blocks(backend: &Arc<dyn Backend>, kv: &PagedKv, blocks: &[usize]) {
    let span = kv.block_span_bytes() as usize;
    for &b in blocks {
        for t in 0..kv.tensors() {
            write(backend, span_at(kv, b, t), &block_pattern(b, t, span));
        }
    }
}

/// Every tensor's span of `now` (the block first written as `was`) holds `was`'s pattern.
fn holds_pattern(backend: &Arc<dyn Backend>, kv: &PagedKv, was: usize, now: usize) {
    let span = kv.block_span_bytes() as usize;
    for t in 0..kv.tensors() {
        let got = read(backend, span_at(kv, now, t), span);
        assert!(
            got == block_pattern(was, t, span),
            "block {was} (now {now}), tensor {t}: contents differ after the compaction"
        );
    }
}

/// A compaction moves the scattered survivors of both layouts onto as few pages as they need
/// (exactly the packed floor), their contents byte-exact under the new ids, the books whole;
/// a second compaction has nothing to do.
pub fn kv_compaction_moves_contents_byte_exact(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let p = pool(&backend, 256 * g);
    // Per layer: 8 blocks per page, 4 tensors. Contiguous: a block is K and V of 2 layers,
    // half a page: 2 blocks per page.
    for layout in [KvLayout::PerLayer, KvLayout::Contiguous] {
        let kv = PagedKv::new(&p, config(g, 8, 2, 64).layout(layout)).expect("cache");
        let all = kv.alloc(64).expect("alloc");
        fill_blocks(&backend, &kv, &all);
        let mut rng = Rng::new(5);
        let (keep, gone): (Vec<usize>, Vec<usize>) =
            all.into_iter().partition(|_| rng.below(4) == 0);
        kv.free(&gone).expect("free");
        let before = kv.stats();
        assert!(
            before.mapped_bytes > before.packed_floor_bytes,
            "{layout:?}: scattered survivors: {before:?}"
        );
        let gain = kv.compaction_gain();
        assert!(gain.moves > 0 && gain.bytes_released > 0, "{gain:?}");
        let c = kv.compact(1000).expect("compact");
        let released = c.give_back.wait();
        assert_eq!(
            (c.moves.len(), released, c.bytes_copied),
            (gain.moves, gain.bytes_released, gain.bytes_to_copy),
            "{layout:?}: did what the gain said"
        );
        assert!(
            c.backing + c.copying <= c.elapsed,
            "{layout:?}: the phases {:?} + {:?} fit in the call's {:?}",
            c.backing,
            c.copying,
            c.elapsed
        );
        let took = c.give_back.took().expect("done");
        assert!(
            c.moves.is_empty() || (c.copying > Duration::ZERO && took > Duration::ZERO),
            "{layout:?}: {} moves timed: copying {:?}, giving back {took:?}",
            c.moves.len(),
            c.copying,
        );
        assert_eq!(
            c.bytes_copied,
            c.moves.len() as u64 * kv.block_span_bytes() * kv.tensors() as u64
        );
        for &(old, new) in &c.moves {
            assert!(keep.contains(&old), "{old} was not live");
            assert!(!kv.is_live(old) && kv.is_live(new), "{old} -> {new}");
        }
        let renamed: Vec<usize> = keep.iter().map(|&b| c.rename(b)).collect();
        let mut unique = renamed.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), keep.len(), "two blocks renamed to one id");
        for (&was, &now) in keep.iter().zip(&renamed) {
            holds_pattern(&backend, &kv, was, now);
        }
        let s = kv.stats();
        assert_eq!(s.live, keep.len());
        assert_eq!(
            s.mapped_bytes, s.packed_floor_bytes,
            "{layout:?}: on the packed floor: {s:?}"
        );
        assert_eq!(before.mapped_bytes - s.mapped_bytes, released);
        assert_eq!(
            p.stats().mapped,
            s.mapped_bytes,
            "the pool got the pages back"
        );
        assert_eq!(
            (s.compactions, s.blocks_moved, s.bytes_compacted),
            (1, c.moves.len() as u64, released)
        );
        books_hold(&backend, &p);
        // A fixpoint.
        assert!(kv.compact(1000).expect("again").is_empty());
        assert_eq!(kv.compaction_gain().moves, 0);
        // The old ids are free, the new ones free normally.
        if let Some(&(old, _)) = c.moves.first() {
            let e = kv.free(&[old]).expect_err("an old id");
            assert!(e.to_string().contains("not allocated"), "{e}");
        }
        kv.free(&renamed).expect("free the renamed blocks");
        assert_eq!(p.stats().mapped, 0);
        drop(kv);
        books_hold(&backend, &p);
    }
}

/// After a spike of interleaved sequences, 90% of them finished in random order, bounded
/// compaction steps bring the idle footprint to <= 1.1x the packed floor plus the low
/// watermark (it was several times that), with warm blocks kept and the books whole.
pub fn kv_compaction_reaches_the_floor_after_a_spike(backend: Arc<dyn Backend>) {
    spike_then_compact(&backend, 16, 1024, 32);
    // The shape of `gpu-bench kv`: 64 blocks a page, sequences of up to 64 blocks, steps of
    // 1024 (moving only into groups denser than the source stopped at 2.52x on the H100).
    spike_then_compact(&backend, 64, 4096, 1024);
}

/// Sequences of 1 to `per_page` blocks up to 80% of `max_blocks`, 90% of them freed in random
/// order, then compactions of at most `step` moves until one moves nothing: at most 1.1x the
/// packed floor (plus the low watermark), every survivor renamed and live.
fn spike_then_compact(backend: &Arc<dyn Backend>, per_page: u64, max_blocks: usize, step: usize) {
    let backend = backend.clone();
    let g = gran(&backend);
    let pages = 2 * (max_blocks as u64).div_ceil(per_page) + 8;
    let p = pool(&backend, pages * g);
    let low = 8;
    let w = Watermarks {
        low,
        high: 32,
        idle_after: Duration::from_millis(50),
        tick: Duration::from_millis(5),
    };
    // 1 layer (2 tensors): a group of `per_page` blocks costs 2 pages.
    let kv = PagedKv::new(&p, config(g, per_page, 1, max_blocks).watermarks(w)).expect("cache");
    let mut rng = Rng::new(23);
    let mut seqs: Vec<Vec<usize>> = Vec::new();
    let mut used = 0;
    while used < max_blocks * 8 / 10 {
        let n = 1 + rng.below(per_page) as usize;
        seqs.push(kv.alloc(n).expect("alloc"));
        used += n;
    }
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let finish = order.len() * 9 / 10;
    for &i in &order[..finish] {
        kv.free(&seqs[i]).expect("free");
    }
    wait_until("idle floor", Duration::from_secs(5), || {
        kv.stats().warm <= low
    });
    let group = 2 * g;
    let floor = |s: &elastic_vmm::kv::PagedKvStats| {
        s.packed_floor_bytes + (low as u64).div_ceil(per_page) * group
    };
    let s = kv.stats();
    let ratio = s.mapped_bytes as f64 / floor(&s) as f64;
    // (Where the look-ahead's timing lands the survivors varies: 2.00x was seen in CI, so the
    // bar for "scattered" is 1.5x; the compaction below must still reach 1.1x.)
    assert!(
        ratio > 1.5,
        "the spike left scattered survivors: {ratio:.2}x {s:?}"
    );
    let mut live: Vec<usize> = order[finish..]
        .iter()
        .flat_map(|&i| seqs[i].clone())
        .collect();
    let mut calls = 0;
    loop {
        let c = kv.compact(step).expect("compact");
        c.give_back.wait();
        assert!(c.moves.len() <= step, "bounded: {}", c.moves.len());
        for b in &mut live {
            *b = c.rename(*b);
        }
        calls += 1;
        if c.is_empty() {
            break;
        }
        assert!(calls < 100, "compaction does not converge");
    }
    let s = kv.stats();
    let ratio = s.mapped_bytes as f64 / floor(&s) as f64;
    assert!(
        ratio <= 1.1,
        "after {calls} compactions: {ratio:.2}x the floor: {s:?}"
    );
    assert!(s.warm >= low.min(s.warm), "{s:?}");
    assert_eq!(s.live, live.len());
    assert!(live.iter().all(|&b| kv.is_live(b)));
    p.audit().expect("audit");
    kv.free(&live).expect("free");
    drop(kv);
    books_hold(&backend, &p);
}

/// Bad input is refused with the numbers; a compaction whose copy fails rolls back: every
/// block keeps its id and contents, the destinations are free again, nothing stays mapped or
/// charged; it succeeds once the fault is gone.
pub fn kv_compaction_bad_input_and_rollback(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let faults = Arc::new(FaultInjector::new(backend.clone()));
    let b: Arc<dyn Backend> = faults.clone();
    let p = pool(&b, 256 * g);
    let kv = PagedKv::new(&p, config(g, 8, 1, 64)).expect("cache");
    let e = kv.compact(0).expect_err("max_moves 0");
    assert!(e.to_string().contains("max_moves is 0"), "{e}");
    // Nothing to do on an empty cache.
    assert!(kv.compact(10).expect("empty").is_empty());
    let all = kv.alloc(64).expect("alloc");
    fill_blocks(&b, &kv, &all);
    // One survivor in every other group: each group's one block fits the holes of others.
    let keep: Vec<usize> = all.iter().copied().filter(|&x| x % 8 < 3).collect();
    let gone: Vec<usize> = all.iter().copied().filter(|&x| x % 8 >= 3).collect();
    kv.free(&gone).expect("free");
    // Asleep: refused.
    p.sleep(&SleepPolicy::offload_all()).expect("sleep");
    let e = kv.compact(10).expect_err("asleep");
    assert!(matches!(e, Error::Asleep { op: "compact", .. }), "{e}");
    p.wake(AfterWake::FreeHostMemory).expect("wake");
    for &x in &keep {
        holds_pattern(&b, &kv, x, x);
    }
    // A bound below a group's live blocks moves nothing (a group moves whole).
    assert!(kv.compact(2).expect("bounded").moves.is_empty());
    if b.info().memory_kind == elastic_vmm::MemoryKind::Host {
        // The host path copies through staging copies: fail the third.
        let (before, mapped) = (kv.stats(), p.stats().mapped);
        faults.fail_copy_nth(3);
        let e = kv.compact(100).expect_err("injected copy failure");
        assert!(
            matches!(e, Error::KvCompactionFailed { .. })
                && e.to_string().contains("FAULT_INJECTED"),
            "{e}"
        );
        faults.clear();
        assert_eq!(kv.stats(), before, "nothing moved");
        assert_eq!(p.stats().mapped, mapped, "nothing mapped or released");
        for &x in &keep {
            assert!(kv.is_live(x));
            holds_pattern(&b, &kv, x, x);
        }
        // Every other block is free: all of them can be allocated.
        let rest = kv
            .alloc(64 - keep.len())
            .expect("the destinations are free again");
        kv.free(&rest).expect("free");
        books_hold(&b, &p);
    }
    let c = kv.compact(100).expect("compact");
    c.give_back.wait();
    assert!(!c.moves.is_empty());
    for &x in &keep {
        holds_pattern(&b, &kv, x, c.rename(x));
    }
    let s = kv.stats();
    assert_eq!(s.mapped_bytes, s.packed_floor_bytes, "{s:?}");
    let renamed: Vec<usize> = keep.iter().map(|&x| c.rename(x)).collect();
    kv.free(&renamed).expect("free");
    drop(kv);
    books_hold(&b, &p);
}

/// A compaction never moves a block an `alloc` has taken but not returned yet: an alloc that
/// takes a warm block and maps a fresh one (slow here) hands out the warm block's id after the
/// compaction ran, so moving it would give the engine a free id (owned twice later).
pub fn kv_compaction_spares_blocks_of_an_alloc_in_progress(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let slow = Arc::new(DelayInjector::new(backend.clone()));
    let b: Arc<dyn Backend> = slow.clone();
    let p = pool(&b, 64 * g);
    let w = Watermarks {
        low: 0,
        high: 1,
        idle_after: Duration::from_secs(60),
        tick: Duration::from_millis(5),
    };
    // 4 blocks per page: groups 0..4 are blocks 0-3, 4-7, 8-11, 12-15.
    let kv = Arc::new(PagedKv::new(&p, config(g, 4, 1, 32).watermarks(w)).expect("cache"));
    kv.alloc(16).expect("alloc");
    kv.free(&[1]).expect("free"); // warm: the only free block on a mapped page
    slow.set_delay(DriverCall::Map, Duration::from_millis(400));
    let (kv2, started) = (kv.clone(), Arc::new(Barrier::new(2)));
    let started2 = started.clone();
    let alloc = std::thread::spawn(move || {
        started2.wait();
        kv2.alloc(2).expect("alloc") // block 1 (warm) and 16 (a fresh page: slow map)
    });
    started.wait();
    std::thread::sleep(Duration::from_millis(100));
    // Group 0 sparse (only the alloc's block 1), a hole in group 1 for it.
    kv.free(&[9]).expect("free"); // warm again
    kv.free(&[0, 2, 3, 7]).expect("free");
    let c = kv.compact(100).expect("compact");
    let ids = alloc.join().expect("alloc thread");
    slow.clear();
    for &(old, new) in &c.moves {
        assert!(
            !ids.contains(&old),
            "block {old} of an alloc in progress ({ids:?}) moved to {new}: the alloc hands out a free id"
        );
    }
    for &x in &ids {
        assert!(kv.is_live(x), "block {x} handed out but not live");
    }
    let live: Vec<usize> = (0..32).filter(|&x| kv.is_live(x)).collect();
    kv.free(&live).expect("free");
    kv.trim();
    assert_eq!(p.stats().mapped, 0);
    books_hold(&b, &p);
}

/// A free naming a block whose alloc has not returned yet (an engine bug) is refused with the
/// reason; it used to mark the block free while the alloc went on to hand it out, so the books
/// counted it free and live at once.
pub fn kv_free_of_a_block_still_being_allocated_is_refused(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let slow = Arc::new(DelayInjector::new(backend.clone()));
    let b: Arc<dyn Backend> = slow.clone();
    let p = pool(&b, 64 * g);
    let kv = Arc::new(PagedKv::new(&p, config(g, 4, 1, 32)).expect("cache"));
    slow.set_delay(DriverCall::Map, Duration::from_millis(300));
    let (kv2, started) = (kv.clone(), Arc::new(Barrier::new(2)));
    let started2 = started.clone();
    let alloc = std::thread::spawn(move || {
        started2.wait();
        kv2.alloc(2).expect("alloc") // blocks 0 and 1, on a fresh page: a slow map
    });
    started.wait();
    std::thread::sleep(Duration::from_millis(100));
    let refused = kv.free(&[0]);
    let ids = alloc.join().expect("alloc thread");
    slow.clear();
    assert_eq!(ids, vec![0, 1]);
    match refused {
        Err(elastic_vmm::Error::KvBadBlock {
            block: 0, reason, ..
        }) => {
            assert!(reason.contains("not handed out yet"), "{reason}")
        }
        other => panic!("a free during the alloc's map went through: {other:?}"),
    }
    assert!(kv.is_live(0) && kv.is_live(1), "{:?}", kv.stats());
    assert_eq!(kv.stats().live, 2);
    kv.free(&ids).expect("free once handed out");
    kv.trim();
    assert_eq!(p.stats().mapped, 0);
    books_hold(&b, &p);
}

/// A compaction returns once its copies are done: giving the emptied pages back (unmaps, tens
/// of microseconds a page on CUDA) runs on a background thread the engine does not wait for.
/// With every unmap, map and release slowed to 150 ms, the call ends before the first of them,
/// a trim waits for the give-back (a limit lowered right after sees the pages back), so does a
/// sleep of the pool (whose unmaps it would refuse: the pages would stay mapped, unused, through
/// it) and the cache's drop (the pool gets everything back).
pub fn kv_compaction_gives_back_after_the_call(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let slow = Arc::new(DelayInjector::new(backend.clone()));
    let b: Arc<dyn Backend> = slow.clone();
    let p = pool(&b, 64 * g);
    // 4 blocks per page, 2 tensors: a group is 2 pages.
    let kv = PagedKv::new(&p, config(g, 4, 1, 32)).expect("cache");
    let ids = kv.alloc(16).expect("alloc");
    fill_blocks(&backend, &kv, &ids);
    // One survivor per group: three of them move into group 0's free slots.
    let keep = [0usize, 5, 10, 15];
    let gone: Vec<usize> = ids.iter().copied().filter(|b| !keep.contains(b)).collect();
    kv.free(&gone).expect("free");
    kv.trim();
    let before = kv.stats();
    assert_eq!(before.mapped_bytes, 4 * 2 * g, "{before:?}");
    let delay = Duration::from_millis(150);
    let slow_down = || {
        for call in [DriverCall::Unmap, DriverCall::Map, DriverCall::Release] {
            slow.set_delay(call, delay);
        }
    };
    slow_down();
    let c = kv.compact(100).expect("compact");
    let given = c.give_back.is_done();
    assert_eq!(c.moves.len(), 3, "{c:?}");
    assert!(
        c.elapsed < delay && !given,
        "the call ({:?}) waited for no unmap ({delay:?} each); give-back done: {given}",
        c.elapsed
    );
    for &x in &keep {
        holds_pattern(&backend, &kv, x, c.rename(x));
    }
    // An alloc meanwhile takes no block of the groups being emptied (their pages still
    // mapped, they would look free of cost, and keep those pages from going back).
    let extra = kv.alloc(1).expect("alloc during the give-back");
    assert!(extra[0] >= 16, "block {} of an emptied group", extra[0]);
    kv.free(&extra).expect("free");
    // The trim waits for the give-back: the pages are back when it returns.
    kv.trim();
    slow.clear();
    assert!(c.give_back.is_done(), "{:?}", c.give_back);
    let s = kv.stats();
    assert_eq!(s.mapped_bytes, 2 * g, "on one group: {s:?}");
    assert_eq!(c.give_back.wait(), 3 * 2 * g);
    assert_eq!(s.bytes_compacted, 3 * 2 * g);
    assert!(c.give_back.took().expect("done") >= delay);
    books_hold(&b, &p);
    // A sleep right after a compaction waits for its give-back: after the wake the cache maps
    // its packed floor, nothing the give-back left behind.
    let now: Vec<usize> = keep.iter().map(|&x| c.rename(x)).collect();
    let more = kv.alloc(12).expect("alloc");
    let gone: Vec<usize> = more.iter().copied().filter(|b| b % 4 != 0).collect();
    kv.free(&gone).expect("free");
    kv.trim();
    slow_down();
    // Group 0 full, one survivor in each of groups 1 to 3: two of them move into group 1.
    let c = kv.compact(100).expect("compact");
    assert_eq!(c.moves.len(), 2, "{more:?} -> {c:?}");
    p.sleep(&SleepPolicy::offload_all()).expect("sleep");
    assert!(c.give_back.is_done(), "the sleep waited: {:?}", c.give_back);
    slow.clear();
    p.wake(AfterWake::FreeHostMemory).expect("wake");
    let s = kv.stats();
    assert_eq!(
        s.mapped_bytes,
        2 * 2 * g,
        "on two groups after the wake: {s:?}"
    );
    assert_eq!(c.give_back.wait(), 2 * 2 * g);
    books_hold(&b, &p);
    // Again with the drop right after: it waits for the give-back, then gives back the rest.
    let survivors: Vec<usize> = now
        .iter()
        .chain(more.iter().filter(|b| *b % 4 == 0))
        .map(|&x| c.rename(x))
        .collect();
    // One block free in group 0, one survivor in group 1: it moves, group 1 empties.
    let (g0, g1): (Vec<usize>, Vec<usize>) = survivors.iter().partition(|&&x| x < 4);
    assert_eq!((g0.len(), g1.len()), (4, 3), "{survivors:?}");
    kv.free(&[g0[0], g1[1], g1[2]]).expect("free");
    slow_down();
    let c = kv.compact(100).expect("compact");
    assert_eq!(c.moves.len(), 1, "{c:?}");
    drop(kv);
    slow.clear();
    assert!(c.give_back.is_done(), "the drop waited: {:?}", c.give_back);
    p.trim().expect("trim");
    assert_eq!(p.stats().mapped, 0, "{:?}", p.stats());
    books_hold(&b, &p);
}

/// Races: compaction (under the engine's step lock, renaming as an engine does) against allocs
/// and frees on several threads, trims, sleep/wake and the look-ahead thread, with slow maps
/// and unmaps. No block is lost or owned twice; at the end every block is live exactly when an
/// owner holds it, and everything goes back.
pub fn kv_compaction_races_alloc_free_trim_sleep(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let slow = Arc::new(DelayInjector::new(backend.clone()));
    slow.set_delay(DriverCall::Map, Duration::from_micros(100));
    slow.set_delay(DriverCall::Unmap, Duration::from_micros(100));
    let b: Arc<dyn Backend> = slow.clone();
    let p = pool(&b, 512 * g);
    let w = Watermarks {
        low: 4,
        high: 16,
        idle_after: Duration::from_millis(10),
        tick: Duration::from_millis(1),
    };
    const N: usize = 256;
    let kv = Arc::new(PagedKv::new(&p, config(g, 8, 2, N).watermarks(w)).expect("cache"));
    // The engine's step lock: its threads alloc and free (and record ids) under it shared; a
    // compaction and the renaming take it alone, as an engine compacts between steps.
    let step = Arc::new(parking_lot::RwLock::new(()));
    let owner: Arc<Vec<AtomicUsize>> = Arc::new((0..N).map(|_| AtomicUsize::new(0)).collect());
    let lists: Arc<Vec<parking_lot::Mutex<Vec<usize>>>> = Arc::new(
        (0..4)
            .map(|_| parking_lot::Mutex::new(Vec::new()))
            .collect(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let moved = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 1..=4usize {
            let (kv, stop, owner, lists, step) = (
                kv.clone(),
                stop.clone(),
                owner.clone(),
                lists.clone(),
                step.clone(),
            );
            s.spawn(move || {
                let mut rng = Rng::new(t as u64 + 100);
                while !stop.load(Ordering::Relaxed) {
                    let _step = step.read();
                    let mut mine = lists[t - 1].lock();
                    if mine.len() < 40 && rng.below(2) == 0 {
                        match kv.alloc(1 + rng.below(8) as usize) {
                            Ok(ids) => {
                                for &i in &ids {
                                    let prev = owner[i].swap(t, Ordering::SeqCst);
                                    assert_eq!(
                                        prev, 0,
                                        "block {i} handed to {t} while {prev} has it"
                                    );
                                }
                                mine.extend(ids);
                            }
                            Err(Error::Asleep { .. }) | Err(Error::KvOutOfBlocks { .. }) => {}
                            Err(e) => panic!("alloc: {e}"),
                        }
                    } else if !mine.is_empty() {
                        // Free a random sample: survivors end up scattered.
                        let n = 1 + rng.below(mine.len() as u64) as usize;
                        let mut gone = Vec::with_capacity(n);
                        for _ in 0..n {
                            let at = rng.below(mine.len() as u64) as usize;
                            gone.push(mine.swap_remove(at));
                        }
                        for &i in &gone {
                            assert_eq!(owner[i].swap(0, Ordering::SeqCst), t, "block {i}");
                        }
                        kv.free(&gone).expect("free");
                    }
                }
            });
        }
        let (kv2, p2, stop2) = (kv.clone(), p.clone(), stop.clone());
        s.spawn(move || {
            let policy = SleepPolicy::discard_all();
            for i in 0..30 {
                std::thread::sleep(Duration::from_millis(4));
                if i % 3 == 0 {
                    kv2.trim();
                } else if i % 3 == 1 && p2.sleep(&policy).is_ok() {
                    std::thread::sleep(Duration::from_millis(2));
                    p2.wake(AfterWake::KeepHostMemory).expect("wake");
                }
            }
            stop2.store(true, Ordering::Relaxed);
        });
        let (kv3, stop3, owner3, lists3, step3) = (
            kv.clone(),
            stop.clone(),
            owner.clone(),
            lists.clone(),
            step.clone(),
        );
        let moved = &moved;
        s.spawn(move || {
            while !stop3.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_micros(500));
                let _gain = kv3.compaction_gain();
                let _step = step3.write();
                let c = match kv3.compact(16) {
                    Ok(c) => c,
                    Err(Error::Asleep { .. }) | Err(Error::KvCompactionFailed { .. }) => continue,
                    Err(e) => panic!("compact: {e}"),
                };
                for &(old, new) in &c.moves {
                    let t = owner3[old].swap(0, Ordering::SeqCst);
                    assert!(t != 0, "block {old} moved while nobody owned it");
                    assert_eq!(
                        owner3[new].swap(t, Ordering::SeqCst),
                        0,
                        "moved onto an owned block {new}"
                    );
                    let mut list = lists3[t - 1].lock();
                    let at = list
                        .iter()
                        .position(|&x| x == old)
                        .expect("in its owner's list");
                    list[at] = new;
                }
                moved.fetch_add(c.moves.len(), Ordering::Relaxed);
            }
        });
    });
    let owned: Vec<usize> = lists.iter().flat_map(|l| l.lock().clone()).collect();
    for x in 0..N {
        let held = owner[x].load(Ordering::SeqCst) != 0;
        assert_eq!(kv.is_live(x), held, "block {x}: live xor free");
    }
    assert_eq!(kv.stats().live, owned.len());
    assert!(
        moved.load(Ordering::Relaxed) > 0,
        "no compaction moved anything: {:?}",
        kv.stats()
    );
    kv.free(&owned).expect("free");
    kv.trim();
    drop(kv);
    slow.clear();
    p.trim().expect("trim");
    assert_eq!(p.stats().mapped, 0);
    books_hold(&b, &p);
}

/// Blocks move from a cache on the pool to a cache of the same shape on a host tier and back,
/// byte-exact, both sides elastic (the source's pages go back, the destination maps what it
/// takes); while a move is under way its blocks are pinned (free refused, both pools refuse to
/// sleep); bad input and a copy that fails change nothing.
pub fn kv_blocks_move_to_a_host_tier_cache_and_back(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let faults = Arc::new(FaultInjector::new(backend.clone()));
    let b: Arc<dyn Backend> = faults.clone();
    let p = pool(&b, 256 * g);
    let ordinal = backend.info().device_ordinal.unwrap_or(0);
    let tier = Pool::host_tier(ordinal, PoolConfig::new(256 * g as usize)).expect("host tier");
    let hb = tier.backend().clone();
    // One block per page of each tensor: a freed block gives its pages back.
    let c = config(g, 1, 2, 16);
    let kv = PagedKv::new(&p, c.clone()).expect("device cache");
    let host = PagedKv::new(&tier, c.clone()).expect("host cache");
    assert_eq!(
        tier.stats().zero_page,
        0,
        "a host tier's cache leaves unbacked pages unmapped"
    );
    let ids = kv.alloc(8).expect("alloc");
    fill_blocks(&b, &kv, &ids);
    let mapped = p.stats().mapped;
    // Bad input first: nothing changes.
    let other = PagedKv::new(&tier, config(g, 2, 2, 16)).expect("other shape");
    let e = kv.move_to(&ids, &other).expect_err("shape");
    assert!(matches!(e, Error::LayoutMismatch { .. }), "{e}");
    let e = kv.move_to(&ids, &kv).expect_err("same cache");
    assert!(e.to_string().contains("two caches"), "{e}");
    let e = kv.move_to(&[ids[0], ids[0]], &host).expect_err("twice");
    assert!(e.to_string().contains("named twice"), "{e}");
    let e = kv.move_to(&[15], &host).expect_err("not allocated");
    assert!(e.to_string().contains("not allocated"), "{e}");
    let small = PagedKv::new(&tier, config(g, 1, 2, 4)).expect("small");
    let e = kv.move_to(&ids, &small).expect_err("too few blocks there");
    assert!(matches!(e, Error::KvOutOfBlocks { .. }), "{e}");
    drop((other, small));
    // A copy that fails: the source stays, the destination gives its blocks back. (Pieces of
    // 2 MiB go through the copy engines, which the injector sees; a forced gather kernel
    // does not.)
    if std::env::var("EVMM_TIER_ENGINE").as_deref() != Ok("kernel") {
        faults.fail_copy_nth(2);
        let e = kv.move_to(&ids, &host).expect_err("injected");
        faults.clear();
        assert!(
            matches!(e, Error::TierMoveFailed { .. }) && e.to_string().contains("FAULT_INJECTED"),
            "{e}"
        );
        assert!(ids.iter().all(|&x| kv.is_live(x)));
        assert_eq!(host.stats().live, 0, "{:?}", host.stats());
        assert_eq!(p.stats().mapped, mapped);
    }
    // Offload six.
    let m = kv.move_to(&ids[..6], &host).expect("offload");
    let moved: Vec<usize> = m.destinations().to_vec();
    assert_eq!(moved.len(), 6);
    let e = kv.free(&ids[..1]).expect_err("pinned");
    assert!(e.to_string().contains("between caches"), "{e}");
    let e = host.free(&moved[..1]).expect_err("pinned");
    assert!(e.to_string().contains("between caches"), "{e}");
    for pool in [&p, &tier] {
        let e = pool
            .sleep(&SleepPolicy::offload_all())
            .expect_err("asleep under a move");
        assert!(e.to_string().contains("between caches"), "{e}");
    }
    let r = m.wait().expect("offload");
    assert_eq!((r.blocks, r.bytes), (6, 6 * 4 * g));
    assert!(ids[..6].iter().all(|&x| !kv.is_live(x)));
    // The source's pages go back after the wait; a trim waits for them.
    kv.trim();
    assert!(p.stats().mapped < mapped, "the device pages went back");
    for (&was, &now) in ids[..6].iter().zip(&moved) {
        holds_pattern(&hb, &host, was, now);
    }
    // Onboard them, the handle dropped unwaited (it settles then).
    let m = host.move_to(&moved, &kv).expect("onboard");
    let back: Vec<usize> = m.destinations().to_vec();
    drop(m);
    assert_eq!(host.stats().live, 0);
    for (&was, &now) in ids[..6].iter().zip(&back) {
        holds_pattern(&b, &kv, was, now);
    }
    kv.free(&back).expect("free");
    kv.free(&ids[6..]).expect("free");
    drop((kv, host));
    books_hold(&b, &p);
    assert_eq!(tier.stats().mapped, 0, "{:?}", tier.stats());
}

/// A move of many blocks runs in batches (each mapped while the copies of the ones before it
/// run): every block arrives whole, in order, both ways. A destination whose pool admits only
/// part of them fails the move part way (a later batch's map is refused), and then everything
/// is as it was: the batches under way finished, the destination gave its blocks and pages
/// back, the source keeps its blocks and bytes and can free them.
pub fn kv_moves_in_batches_and_rolls_back_whole(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let p = pool(&backend, 1024 * g);
    let ordinal = backend.info().device_ordinal.unwrap_or(0);
    // One block per page of each of its two tensors: 100 blocks map 200 pages.
    let c = config(g, 1, 1, 128);
    let kv = PagedKv::new(&p, c.clone()).expect("device cache");
    let n = 100;
    let ids = kv.alloc(n).expect("alloc");
    fill_blocks(&backend, &kv, &ids);
    let tier = Pool::host_tier(ordinal, PoolConfig::new(1024 * g as usize)).expect("host tier");
    let hb = tier.backend().clone();
    let host = PagedKv::new(&tier, c.clone()).expect("host cache");
    let m = kv.move_to(&ids, &host).expect("offload");
    let to = m.destinations().to_vec();
    let r = m.wait().expect("offload");
    assert_eq!((r.blocks, to.len()), (n, n));
    for (&was, &now) in ids.iter().zip(&to) {
        holds_pattern(&hb, &host, was, now);
    }
    let m = host.move_to(&to, &kv).expect("onboard");
    let home = m.destinations().to_vec();
    m.wait().expect("onboard");
    for (&was, &now) in ids.iter().zip(&home) {
        holds_pattern(&backend, &kv, was, now);
    }
    assert_eq!(host.stats().live, 0);
    drop(host);

    // A tier admitting 55 blocks' pages: the first batch (32 blocks) maps, the second fails.
    let small = Pool::host_tier(
        ordinal,
        PoolConfig::new(1024 * g as usize).physical_limit(110 * g),
    )
    .expect("limited host tier");
    let host = PagedKv::new(&small, c).expect("limited host cache");
    let e = kv.move_to(&home, &host).expect_err("over the tier's limit");
    assert!(
        !matches!(e, Error::KvOutOfBlocks { .. }),
        "the cache has the blocks, its pool refuses their pages: {e}"
    );
    assert!(
        small.stats().peak_physical >= 64 * g,
        "the first batch (32 blocks, 64 pages) was mapped before the second was refused: {:?}",
        small.stats()
    );
    assert_eq!(host.stats().live, 0, "{:?}", host.stats());
    host.trim();
    assert_eq!(small.stats().mapped, 0, "{:?}", small.stats());
    for (&was, &now) in ids.iter().zip(&home) {
        assert!(kv.is_live(now));
        holds_pattern(&backend, &kv, was, now);
    }
    kv.free(&home).expect("the sources are the engine's again");
    drop((kv, host));
    books_hold(&backend, &p);
}

/// Moves between a device cache and a host-tier cache race compaction, frees and sleeps, many
/// rounds: a mover offloads its blocks (every fourth round 40 of them, a move of two batches),
/// leaves the move under way while a compactor packs the
/// cache (its ids renamed in the owners' lists, as an engine does between steps) and the pools
/// try to sleep, then settles and brings them back; scattering threads alloc and free around
/// it. Every moved block comes back byte-exact, no pinned block is ever compacted (the move's
/// settle would free a renamed id and leak the block: the live counts would not add up), and
/// the books hold.
pub fn kv_moves_race_compaction_free_and_sleep(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let p = pool(&backend, 512 * g);
    let ordinal = backend.info().device_ordinal.unwrap_or(0);
    let tier = Pool::host_tier(ordinal, PoolConfig::new(512 * g as usize)).expect("host tier");
    const N: usize = 128;
    let c = config(g, 8, 2, N);
    let kv = Arc::new(PagedKv::new(&p, c.clone()).expect("device cache"));
    let host = Arc::new(PagedKv::new(&tier, c).expect("host cache"));
    let step = Arc::new(parking_lot::RwLock::new(()));
    // The mover touches its blocks' memory (writes, checks) only while no pool sleeps; a move
    // under way does not hold it (the pins keep the pools awake then).
    let awake = Arc::new(parking_lot::RwLock::new(()));
    // Blocks of the scattering threads (renamed by the compactor); the mover's are its own.
    let lists: Arc<Vec<parking_lot::Mutex<Vec<usize>>>> = Arc::new(
        (0..2)
            .map(|_| parking_lot::Mutex::new(Vec::new()))
            .collect(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let (moved, compacted, refused_sleeps) = (
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    );
    let hb = tier.backend().clone();
    std::thread::scope(|s| {
        for t in 0..2usize {
            let (kv, stop, lists, step) = (kv.clone(), stop.clone(), lists.clone(), step.clone());
            s.spawn(move || {
                let mut rng = Rng::new(t as u64 + 7);
                while !stop.load(Ordering::Relaxed) {
                    let _step = step.read();
                    let mut mine = lists[t].lock();
                    if mine.len() < 24 && rng.below(2) == 0 {
                        match kv.alloc(1 + rng.below(6) as usize) {
                            Ok(ids) => mine.extend(ids),
                            Err(Error::Asleep { .. }) | Err(Error::KvOutOfBlocks { .. }) => {}
                            Err(e) => panic!("alloc: {e}"),
                        }
                    } else if !mine.is_empty() {
                        let at = rng.below(mine.len() as u64) as usize;
                        let x = mine.swap_remove(at);
                        kv.free(&[x]).expect("free");
                    }
                }
            });
        }
        {
            let (kv, stop, lists, step) = (kv.clone(), stop.clone(), lists.clone(), step.clone());
            let compacted = &compacted;
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_micros(300));
                    let _step = step.write();
                    let c = match kv.compact(32) {
                        Ok(c) => c,
                        Err(Error::Asleep { .. }) | Err(Error::KvCompactionFailed { .. }) => {
                            continue
                        }
                        Err(e) => panic!("compact: {e}"),
                    };
                    for l in lists.iter() {
                        for x in l.lock().iter_mut() {
                            *x = c.rename(*x);
                        }
                    }
                    compacted.fetch_add(c.moves.len(), Ordering::Relaxed);
                }
            });
        }
        {
            let (p, tier, stop, awake) = (p.clone(), tier.clone(), stop.clone(), awake.clone());
            let refused_sleeps = &refused_sleeps;
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(1));
                    let _asleep = awake.write();
                    for pool in [&p, &tier] {
                        match pool.sleep(&SleepPolicy::offload_all()) {
                            Ok(_) => {
                                std::thread::sleep(Duration::from_micros(200));
                                pool.wake(AfterWake::KeepHostMemory).expect("wake");
                            }
                            Err(Error::SleepRefused { .. }) => {
                                refused_sleeps.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("sleep: {e}"),
                        }
                    }
                }
            });
        }
        // The mover; the others stop when it ends, also by a panic.
        struct StopOnDrop(Arc<AtomicBool>);
        impl Drop for StopOnDrop {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _stop = StopOnDrop(stop.clone());
        let span = kv.block_span_bytes() as usize;
        // Out, left under way while the others run; retried while a pool sleeps.
        let retry = |f: &dyn Fn() -> elastic_vmm::Result<elastic_vmm::kv::KvMove>| loop {
            match f() {
                Ok(m) => break m,
                Err(Error::Asleep { .. }) => std::thread::sleep(Duration::from_micros(100)),
                Err(e) => panic!("move: {e}"),
            }
        };
        // The step lock keeps the compactor off the mover's blocks whenever no move pins them
        // (they are in no list it renames); it is not held while a move is under way.
        for round in 0..40usize {
            let pattern = |i: usize, t: usize| block_pattern(round * 8 + i, t, span);
            // Every fourth round moves 40 blocks: two batches (32 and 8) under way together.
            let n = if round % 4 == 3 { 40 } else { 4 };
            let m = {
                let _step = step.read();
                let ids = loop {
                    match kv.alloc(n) {
                        Ok(ids) => break ids,
                        Err(Error::Asleep { .. }) | Err(Error::KvOutOfBlocks { .. }) => {
                            std::thread::sleep(Duration::from_micros(100))
                        }
                        Err(e) => panic!("alloc: {e}"),
                    }
                };
                let _touching = awake.read();
                for (i, &x) in ids.iter().enumerate() {
                    for t in 0..kv.tensors() {
                        write(&backend, span_at(&kv, x, t), &pattern(i, t));
                    }
                }
                drop(_touching);
                retry(&|| kv.move_to(&ids, &host))
            };
            std::thread::sleep(Duration::from_micros(500));
            let out = m.destinations().to_vec();
            m.wait().expect("offload");
            {
                let _touching = awake.read();
                for (i, &x) in out.iter().enumerate() {
                    for t in 0..kv.tensors() {
                        assert!(
                            read(&hb, span_at(&host, x, t), span) == pattern(i, t),
                            "round {round}: block {i} differs on the host"
                        );
                    }
                }
            }
            let m = retry(&|| host.move_to(&out, &kv));
            std::thread::sleep(Duration::from_micros(500));
            let back = m.destinations().to_vec();
            let _step = step.read();
            m.wait().expect("onboard");
            let _touching = awake.read();
            for (i, &x) in back.iter().enumerate() {
                for t in 0..kv.tensors() {
                    assert!(
                        read(&backend, span_at(&kv, x, t), span) == pattern(i, t),
                        "round {round}: block {i} differs back on the device"
                    );
                }
            }
            kv.free(&back).expect("free the mover's blocks");
            moved.fetch_add(4, Ordering::Relaxed);
        }
    });
    let owned: Vec<usize> = lists.iter().flat_map(|l| l.lock().clone()).collect();
    assert_eq!(kv.stats().live, owned.len(), "{:?}", kv.stats());
    assert_eq!(host.stats().live, 0, "{:?}", host.stats());
    assert!(
        compacted.load(Ordering::Relaxed) > 0,
        "no compaction moved anything"
    );
    eprintln!(
        "moved {} blocks each way; compaction moved {}; {} sleeps refused",
        moved.load(Ordering::Relaxed),
        compacted.load(Ordering::Relaxed),
        refused_sleeps.load(Ordering::Relaxed)
    );
    kv.free(&owned).expect("free");
    drop((kv, host));
    books_hold(&backend, &p);
}

/// A trim holds until the next alloc: the look-ahead thread maps nothing back in between (a
/// reclaim's trim under a limit being lowered was undone a tick later: the lowering then saw
/// the refill and failed, `ChangeNotReached` on the H100). Then an alloc lets it refill.
pub fn kv_trim_holds_until_the_next_alloc(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let p = pool(&backend, 256 * g);
    let w = Watermarks {
        low: 2,
        high: 4,
        idle_after: Duration::from_secs(60),
        tick: Duration::from_millis(2),
    };
    let kv = PagedKv::new(&p, config(g, 2, 1, 64).watermarks(w)).expect("cache");
    let ids = kv.alloc(6).expect("alloc");
    wait_until("warm up to the high mark", Duration::from_secs(5), || {
        kv.stats().warm >= 2
    });
    kv.free(&ids).expect("free");
    assert!(kv.trim() > 0);
    let mapped = p.stats().mapped;
    for _ in 0..25 {
        std::thread::sleep(Duration::from_millis(4));
        assert_eq!(kv.stats().warm, 0, "the look-ahead refilled after a trim");
        assert_eq!(p.stats().mapped, mapped);
    }
    let one = kv.alloc(1).expect("alloc");
    wait_until("refilled after the alloc", Duration::from_secs(5), || {
        kv.stats().warm >= 2
    });
    kv.free(&one).expect("free");
}

/// A trim holds also against a refill the look-ahead thread had under way when the trim came:
/// with the maps slowed, an alloc drains the warm blocks, the thread starts mapping ahead, and
/// a trim lands while its first map is in flight. Nothing may be warm (or newly mapped) after
/// the trim until the next alloc. Today the thread's in-flight batch lands after the trim, and
/// `map_ahead` goes on with further batches without looking at `trimmed` again: a reclaim's
/// trim under a lowered limit is undone, the same `ChangeNotReached` the fix for a refill a
/// tick later was meant to cure.
pub fn kv_trim_holds_against_a_refill_under_way(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let slow = Arc::new(DelayInjector::new(backend.clone()));
    let b: Arc<dyn Backend> = slow.clone();
    let p = pool(&b, 256 * g);
    let w = Watermarks {
        low: 2,
        high: 4,
        idle_after: Duration::from_secs(60),
        tick: Duration::from_millis(2),
    };
    // One block per page: every warm block the thread makes is one page per tensor.
    let kv = PagedKv::new(&p, config(g, 1, 1, 64).watermarks(w)).expect("cache");
    slow.set_delay(DriverCall::Map, Duration::from_millis(150));
    // The alloc maps its own blocks slowly, and the thread refills (slowly) from then on.
    let ids = kv.alloc(2).expect("alloc");
    let maps = slow.calls(DriverCall::Map);
    // Mapping now (usually), or done already (under load the refill can finish during the
    // alloc: the trim then meets warm blocks, and nothing may come back either).
    wait_until(
        "the look-ahead started mapping",
        Duration::from_secs(5),
        || slow.calls(DriverCall::Map) > maps || kv.stats().warm > 0,
    );
    kv.trim();
    let mapped = p.stats().mapped;
    // Long enough for the thread to finish its batch and start (and finish) several more.
    std::thread::sleep(Duration::from_millis(1500));
    let (warm, now) = (kv.stats().warm, p.stats().mapped);
    slow.clear();
    // Nothing warm and nothing mapped since (a refill caught half mapped by the trim gives
    // back what it had mapped, so the footprint may shrink).
    assert!(
        warm == 0 && now <= mapped,
        "the look-ahead's refill under way landed after the trim ({warm} warm blocks, {} bytes mapped since)",
        now.saturating_sub(mapped)
    );
    kv.free(&ids).expect("free");
}

/// `move_to_after` between two caches on host tiers (host <-> host: no device copy a stream
/// could order) is refused with nothing changed, as its documentation says. Today the two host
/// pools go through the source backend's "streamed" copies, so the stream is accepted (and,
/// on CUDA, a marker recorded on it) and the move runs.
pub fn kv_move_after_between_host_caches_is_refused(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let ordinal = backend.info().device_ordinal.unwrap_or(0);
    let a = Pool::host_tier(ordinal, PoolConfig::new(64 * g as usize)).expect("host tier a");
    let b = Pool::host_tier(ordinal, PoolConfig::new(64 * g as usize)).expect("host tier b");
    let c = config(g, 1, 1, 8);
    let ka = PagedKv::new(&a, c.clone()).expect("cache a");
    let kb = PagedKv::new(&b, c).expect("cache b");
    let ids = ka.alloc(2).expect("alloc");
    // SAFETY: the legacy default stream (a special handle) is live; refused before use.
    let r = unsafe { ka.move_to_after(&ids, &kb, 1) };
    let settled = r.map(|m| m.wait());
    assert!(
        settled.is_err(),
        "host <-> host move_to_after was accepted: {settled:?}"
    );
    assert!(ids.iter().all(|&x| ka.is_live(x)));
    assert_eq!(kb.stats().live, 0);
    ka.free(&ids).expect("free");
}

/// `alloc` counts free blocks that a release or the look-ahead holds out of the free lists
/// while it unmaps or maps them (issue 33, defect 4): with nothing live, every block is
/// allocatable. Two windows widened with slow driver calls: a `free` whose unmaps take 100 ms,
/// and the look-ahead mapping a block in 60 ms. Today both answer `KvOutOfBlocks` (`live 0`,
/// the blocks in neither list), and succeed once the release or the map finished.
pub fn kv_alloc_counts_blocks_in_transit(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let slow = Arc::new(DelayInjector::new(backend.clone()));
    let b: Arc<dyn Backend> = slow.clone();
    let p = pool(&b, 64 * g);
    // A release under way: every block freed, their pages unmapping slowly (unaliased pages:
    // a release over zero-page aliases replaces the mapping without an unmap call).
    let kv = PagedKv::new(&p, config(g, 1, 1, 4).zero_unbacked(false)).expect("cache");
    let ids = kv.alloc(4).expect("alloc");
    slow.set_delay(DriverCall::Unmap, Duration::from_millis(100));
    let unmaps = slow.calls(DriverCall::Unmap);
    let mut failed = Vec::new();
    std::thread::scope(|s| {
        s.spawn(|| kv.free(&ids).expect("free"));
        wait_until(
            "the release started unmapping",
            Duration::from_secs(5),
            || slow.calls(DriverCall::Unmap) > unmaps,
        );
        let live = kv.stats().live;
        match kv.alloc(4) {
            Ok(got) => kv.free(&got).expect("free"),
            Err(e) => failed.push(format!(
                "alloc(4) with {live} blocks live of 4 while a release unmaps: {e:?}"
            )),
        }
    });
    slow.clear();
    drop(kv);
    // The look-ahead under way: 4 blocks live, 4 free, one of them mapping slowly.
    let w = Watermarks {
        low: 4,
        high: 4,
        idle_after: Duration::from_secs(60),
        tick: Duration::from_millis(2),
    };
    let kv = PagedKv::new(&p, config(g, 1, 1, 8).watermarks(w)).expect("cache");
    wait_until("the look-ahead at rest", Duration::from_secs(5), || {
        kv.stats().warm == 4
    });
    slow.set_delay(DriverCall::Map, Duration::from_millis(60));
    let maps = slow.calls(DriverCall::Map);
    let ids = kv.alloc(4).expect("alloc of the warm blocks");
    wait_until(
        "the look-ahead started mapping",
        Duration::from_secs(5),
        || slow.calls(DriverCall::Map) > maps,
    );
    let live = kv.stats().live;
    match kv.alloc(4) {
        Ok(got) => kv.free(&got).expect("free"),
        Err(e) => failed.push(format!(
            "alloc(4) with {live} blocks live of 8 while the look-ahead maps: {e:?}"
        )),
    }
    slow.clear();
    kv.free(&ids).expect("free");
    drop(kv);
    books_hold(&backend, &p);
    assert!(failed.is_empty(), "{}", failed.join("; "));
}

/// A trim holds against frees too (issue 33, defect 5): blocks freed after a reclaim's trim,
/// with no alloc since, are given back rather than kept warm up to the high watermark. Today
/// `free` ignores the trim: 8 blocks warm and their pages mapped after the trim.
pub fn kv_trim_holds_against_frees(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let p = pool(&backend, 256 * g);
    let w = Watermarks {
        low: 2,
        high: 8,
        idle_after: Duration::from_secs(60),
        tick: Duration::from_millis(2),
    };
    // One block per page: a warm block holds a page per tensor.
    let kv = PagedKv::new(&p, config(g, 1, 1, 64).watermarks(w)).expect("cache");
    // At rest first: an alloc during the first fill would leave the thread short of `high`.
    wait_until("the look-ahead at rest", Duration::from_secs(5), || {
        kv.stats().warm == 8
    });
    let ids = kv.alloc(8).expect("alloc");
    wait_until("refilled to the high mark", Duration::from_secs(5), || {
        kv.stats().warm == 8
    });
    kv.trim();
    kv.free(&ids).expect("free");
    let s = kv.stats();
    assert!(
        s.warm == 0 && s.mapped_bytes == 0,
        "frees after a trim refilled the warm set: {} warm, {} bytes mapped",
        s.warm,
        s.mapped_bytes
    );
    let one = kv.alloc(1).expect("alloc");
    wait_until("refilled after the alloc", Duration::from_secs(5), || {
        kv.stats().warm >= 2
    });
    kv.free(&one).expect("free");
}

/// A limit lowered to the live footprint holds while the look-ahead refills (issue 33,
/// defect 9): the model's reclaim callback trims, and the trim must not return while a
/// look-ahead batch is charged and still mapping. Watermarks (32, 64) at rest, maps slowed to
/// 25 ms, `alloc(40)` (the thread starts refilling), 30 ms later the limit goes to the live
/// footprint. Today `ChangeNotReached`: one batch of the refill (a page per tensor) still in
/// use after the trim.
pub fn kv_limit_lowering_holds_against_a_refill_in_flight(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let slow = Arc::new(DelayInjector::new(backend.clone()));
    let b: Arc<dyn Backend> = slow.clone();
    let shared = SharedPool::new(b, SharedPoolConfig::new()).expect("shared");
    let slot: Arc<OnceLock<Arc<PagedKv>>> = Arc::new(OnceLock::new());
    let cb = slot.clone();
    let m = shared
        .register(
            ModelConfig::new("m", (512 * g) as usize, 256 * g).on_reclaim(move |_| {
                if let Some(kv) = cb.get() {
                    kv.trim();
                }
            }),
        )
        .expect("model");
    let w = Watermarks {
        low: 32,
        high: 64,
        idle_after: Duration::from_secs(60),
        tick: Duration::from_millis(2),
    };
    // Four blocks per page, one layer: a batch of the look-ahead is a page in each tensor.
    // Unbacked pages left unmapped: the trim's unmaps then make no (slowed) alias maps.
    let c = config(g, 4, 1, 256).watermarks(w).zero_unbacked(false);
    let kv = Arc::new(PagedKv::new(&m, c).expect("cache"));
    if slot.set(kv.clone()).is_err() {
        panic!("the slot is set once");
    }
    wait_until("the look-ahead at rest", Duration::from_secs(5), || {
        kv.stats().warm == 64
    });
    slow.set_delay(DriverCall::Map, Duration::from_millis(25));
    let ids = kv.alloc(40).expect("alloc");
    std::thread::sleep(Duration::from_millis(30));
    let floor = kv.stats().packed_floor_bytes;
    let r = shared.set_limit("m", floor);
    slow.clear();
    assert!(
        r.is_ok(),
        "lowering the limit to the live footprint ({floor} bytes) while the look-ahead refills: {r:?}"
    );
    kv.free(&ids).expect("free");
}

/// Bytes that are not zero in the first `len` bytes of every block of every tensor of `kv`
/// that is not live (blocks nobody holds now; pages under none of them read the zero page).
fn stale_bytes_in_free_blocks(backend: &Arc<dyn Backend>, kv: &PagedKv, len: usize) -> usize {
    let mut stale = 0;
    for id in (0..kv.config().max_blocks).filter(|&id| !kv.is_live(id)) {
        for t in 0..kv.tensors() {
            let at = kv.tensor_addr(t).expect("tensor") + id as u64 * kv.block_span_bytes();
            stale += read(backend, at, len).iter().filter(|&&b| b != 0).count();
        }
    }
    stale
}

/// Issue 33, defect 3: a page mapped for one block must not show what its chunk held before
/// under the blocks nobody allocated. Blocks 0 and 1 (one page) are written with 0x5A and
/// freed (the chunk goes to the pool's cache); one block allocated again maps that chunk.
pub fn kv_free_blocks_never_show_earlier_bytes(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let p = pool(&backend, 64 * g);
    let kv = PagedKv::new(&p, config(g, 2, 1, 8)).expect("cache");
    for round in 0..3 {
        let both = kv.alloc(2).expect("alloc 2");
        for &id in &both {
            for t in 0..kv.tensors() {
                let at = kv.tensor_addr(t).expect("tensor") + id as u64 * kv.block_span_bytes();
                write(&backend, at, &vec![0x5A; kv.block_span_bytes() as usize]);
            }
        }
        kv.free(&both).expect("free");
        assert!(
            p.stats().cached > 0,
            "round {round}: the chunks wait in the cache"
        );
        let one = kv.alloc(1).expect("alloc 1");
        let stale = stale_bytes_in_free_blocks(&backend, &kv, 1024);
        assert_eq!(
            stale, 0,
            "round {round}: {stale} bytes of blocks nobody holds show earlier data"
        );
        kv.free(&one).expect("free");
    }
    books_hold(&backend, &p);
}

/// Block 0's span in every tensor reads zeros.
fn null_reads_zeros(backend: &Arc<dyn Backend>, kv: &PagedKv, what: &str) {
    let len = kv.block_span_bytes() as usize;
    for t in 0..kv.tensors() {
        let got = read(backend, span_at(kv, 0, t), len);
        let bad = got.iter().filter(|&&x| x != 0).count();
        assert_eq!(
            bad, 0,
            "{what}: {bad} bytes of the null block in tensor {t} are not 0"
        );
    }
}

/// The reserved null block ([`PagedKvConfig::null_block`]): backed and zero from creation,
/// charged to the model and counted in the pool's books, never handed out, freed, moved or
/// compacted; the rest of the cache allocates whole; after a sleep that discards KV it is zero
/// again.
pub fn kv_null_block_is_reserved_backed_and_zero(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    assert!(matches!(
        PagedKv::new(&pool(&backend, 8 * g), config(g, 4, 1, 1).null_block(true)),
        Err(Error::InvalidArgument(_))
    ));
    let shared = SharedPool::new(backend.clone(), SharedPoolConfig::new()).expect("shared");
    let m = shared
        .register(ModelConfig::new("m", (64 * g) as usize, 64 * g))
        .expect("model");
    let used = || {
        shared
            .model("m")
            .expect("m")
            .model_stats()
            .expect("stats")
            .used
    };
    let used_before = used();
    // Two layers (4 tensors), 4 blocks per page, 16 blocks.
    let kv = PagedKv::new(&m, config(g, 4, 2, 16).null_block(true)).expect("cache");
    let group = 4 * g;
    // The pool's zero page (one granule) is charged too, while the cache lives.
    let zero = g;
    assert_eq!(kv.null_block(), Some(0));
    assert!(!kv.is_live(0), "the null block is not allocated");
    let s = kv.stats();
    assert!(s.null_block && s.live == 0 && s.warm == 0, "{s:?}");
    assert_eq!(s.mapped_bytes, group, "the null block's pages are mapped");
    assert_eq!(s.packed_floor_bytes, group, "and part of the floor");
    assert_eq!(used() - used_before, group + zero, "charged to the model");
    assert_eq!(m.stats().mapped, group, "in the pool's books");
    null_reads_zeros(&backend, &kv, "at creation");
    assert_eq!(kv.available(), 15, "every other block can be had");
    // Bad ids are refused, the null block by name.
    match kv.free(&[0]) {
        Err(Error::KvBadBlock {
            block: 0, reason, ..
        }) => {
            assert!(reason.contains("null block"), "reason: {reason}")
        }
        other => panic!("free of the null block: {other:?}"),
    }
    // A full alloc of the rest, never block 0.
    let ids = kv.alloc(15).expect("every other block");
    assert_eq!(ids.len(), 15);
    assert!(
        !ids.contains(&0),
        "alloc handed out the null block: {ids:?}"
    );
    assert!(matches!(
        kv.alloc(1),
        Err(Error::KvOutOfBlocks { free: 0, .. })
    ));
    fill_blocks(&backend, &kv, &ids);
    null_reads_zeros(&backend, &kv, "with every other block written");
    assert_eq!(kv.stats().mapped_bytes, 4 * group);
    assert_eq!(used() - used_before, 4 * group + zero);
    match kv.free(&[ids[0], 0]) {
        Err(Error::KvBadBlock { block: 0, .. }) => {}
        other => panic!("a free naming the null block: {other:?}"),
    }
    assert!(kv.is_live(ids[0]), "a refused free frees nothing");
    // Keep one block on the null block's page and a few elsewhere; compaction packs them
    // around the null block, which stays.
    let keep = [1usize, 6, 11];
    let gone: Vec<usize> = ids.iter().copied().filter(|b| !keep.contains(b)).collect();
    kv.free(&gone).expect("free");
    kv.trim();
    let c = kv.compact(usize::MAX).expect("compact");
    c.give_back.wait();
    assert!(c.new_id(0).is_none(), "the null block was not moved");
    assert!(
        c.moves.iter().all(|&(_, to)| to != 0),
        "nothing moved into the null block: {:?}",
        c.moves
    );
    assert_eq!(
        kv.stats().mapped_bytes,
        group,
        "packed around the null block"
    );
    null_reads_zeros(&backend, &kv, "after a compaction");
    let now: Vec<usize> = keep.iter().map(|&b| c.rename(b)).collect();
    kv.free(&now).expect("free the rest");
    kv.trim();
    let s = kv.stats();
    assert_eq!((s.live, s.warm, s.mapped_bytes), (0, 0, group), "{s:?}");
    m.trim().expect("trim the pool's cache");
    assert_eq!(
        used() - used_before,
        group + zero,
        "the null block stays charged"
    );
    // A sleep that discards KV: the null block's contents go with the rest; the wake makes it
    // zero again. Bytes written into it behind the cache's back stand for lost contents.
    for t in 0..kv.tensors() {
        write(&backend, span_at(&kv, 0, t), &[0x5A; 64]);
    }
    let policy = SleepPolicy::offload_all().tag(Tag::Kv, SleepAction::Discard);
    m.sleep(&policy).expect("sleep");
    m.wake(AfterWake::KeepHostMemory).expect("wake");
    null_reads_zeros(&backend, &kv, "after a discarding sleep");
    assert_eq!(kv.stats().mapped_bytes, group);
    drop(kv);
    m.trim().expect("trim");
    assert_eq!(m.stats().mapped, 0, "the drop gives the null block back");
    assert_eq!(m.stats().zero_page, 0, "and the zero page");
    assert_eq!(used(), used_before);
    m.audit().expect("audit");
}

/// A padded block table read while neighbours churn: block 0 (the null block) reads zeros all
/// along while other threads allocate, write, free, trim and compact the blocks on its pages
/// and others, with slow maps and unmaps and the look-ahead running; no alloc returns 0.
pub fn kv_null_block_reads_zeros_while_neighbours_churn(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let slow = Arc::new(DelayInjector::new(backend.clone()));
    slow.set_delay(DriverCall::Map, Duration::from_micros(200));
    slow.set_delay(DriverCall::Unmap, Duration::from_micros(200));
    let b: Arc<dyn Backend> = slow.clone();
    let p = pool(&b, 256 * g);
    let w = Watermarks {
        low: 2,
        high: 6,
        idle_after: Duration::from_millis(5),
        tick: Duration::from_millis(1),
    };
    const N: usize = 64;
    let kv = Arc::new(
        PagedKv::new(&p, config(g, 4, 1, N).watermarks(w).null_block(true)).expect("cache"),
    );
    let step = Arc::new(parking_lot::RwLock::new(()));
    let lists: Arc<Vec<parking_lot::Mutex<Vec<usize>>>> = Arc::new(
        (0..3)
            .map(|_| parking_lot::Mutex::new(Vec::new()))
            .collect(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let reads = AtomicUsize::new(0);
    let rounds = AtomicUsize::new(0);
    let span = kv.block_span_bytes() as usize;
    let started = Instant::now();
    std::thread::scope(|s| {
        // The reader: a kernel reading a padded table.
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                for t in 0..kv.tensors() {
                    let got = read(&backend, span_at(&kv, 0, t), span);
                    assert!(
                        got.iter().all(|&x| x == 0),
                        "the null block of tensor {t} read non-zero bytes"
                    );
                    reads.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        for t in 0..3usize {
            let (kv, lists, step, stop) = (kv.clone(), lists.clone(), step.clone(), stop.clone());
            let (b, rounds) = (b.clone(), &rounds);
            s.spawn(move || {
                let mut rng = Rng::new(7 + t as u64);
                while !stop.load(Ordering::Relaxed) {
                    let _g = step.read();
                    let mut mine = lists[t].lock();
                    if mine.len() < 16 && rng.below(2) == 0 {
                        match kv.alloc(1 + rng.below(4) as usize) {
                            Ok(ids) => {
                                assert!(!ids.contains(&0), "alloc handed out the null block");
                                // Written as an engine writes KV: a wrong mapping would show
                                // these bytes under block 0.
                                for &i in &ids {
                                    for tt in 0..kv.tensors() {
                                        write(&b, span_at(&kv, i, tt), &vec![0xA5; span]);
                                    }
                                }
                                mine.extend(ids);
                            }
                            Err(Error::KvOutOfBlocks { .. }) => {}
                            Err(e) => panic!("alloc: {e}"),
                        }
                    } else if !mine.is_empty() {
                        let n = 1 + rng.below(mine.len() as u64) as usize;
                        let gone: Vec<usize> = mine.drain(..n).collect();
                        kv.free(&gone).expect("free");
                    }
                    rounds.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        // Reclaim-style trims and compactions between steps.
        let mut i = 0;
        while started.elapsed() < Duration::from_millis(1500) {
            std::thread::sleep(Duration::from_millis(3));
            if i % 2 == 0 {
                kv.trim();
            } else {
                let _g = step.write();
                let c = kv.compact(64).expect("compact");
                assert!(c.new_id(0).is_none(), "the null block moved");
                for l in lists.iter() {
                    for id in l.lock().iter_mut() {
                        *id = c.rename(*id);
                    }
                }
            }
            i += 1;
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(
        rounds.load(Ordering::Relaxed) > 100,
        "the neighbours churned"
    );
    assert!(reads.load(Ordering::Relaxed) > 100, "the reader read");
    for l in lists.iter() {
        kv.free(&l.lock()).expect("free at the end");
    }
    kv.trim();
    // Releases the look-ahead's idle return started (slowed unmaps) may still be landing.
    wait_until(
        "the cache back to its null block",
        Duration::from_secs(10),
        || {
            let s = kv.stats();
            (s.live, s.mapped_bytes) == (0, 2 * g)
        },
    );
    null_reads_zeros(&b, &kv, "at the end");
    drop(kv);
    slow.clear();
    p.trim().expect("trim");
    assert_eq!(p.stats().mapped, 0);
    books_hold(&b, &p);
}

/// A move between caches returns from its wait once the copies are done: the source's pages
/// go back on a background thread (unmaps and releases slowed to 150 ms each here), a trim
/// waits for them, a sleep right after the wait waits for them, and so does the cache's drop.
pub fn kv_move_gives_the_source_back_after_the_wait(backend: Arc<dyn Backend>) {
    let g = gran(&backend);
    let slow = Arc::new(DelayInjector::new(backend.clone()));
    let b: Arc<dyn Backend> = slow.clone();
    let p = pool(&b, 256 * g);
    let ordinal = backend.info().device_ordinal.unwrap_or(0);
    let tier = Pool::host_tier(ordinal, PoolConfig::new(256 * g as usize)).expect("host tier");
    // One block per page of each tensor: a freed block gives its pages back.
    let c = config(g, 1, 2, 16);
    let kv = PagedKv::new(&p, c.clone()).expect("device cache");
    let host = PagedKv::new(&tier, c).expect("host cache");
    let ids = kv.alloc(4).expect("alloc");
    fill_blocks(&b, &kv, &ids);
    let mapped = p.stats().mapped;
    let delay = Duration::from_millis(150);
    for call in [DriverCall::Unmap, DriverCall::Release] {
        slow.set_delay(call, delay);
    }
    let t = Instant::now();
    let m = kv.move_to(&ids, &host).expect("offload");
    let moved = m.destinations().to_vec();
    m.wait().expect("offload");
    let waited = t.elapsed();
    assert!(
        waited < delay,
        "the wait ({waited:?}) waited for no unmap of the source ({delay:?} each)"
    );
    assert_eq!(
        p.stats().mapped,
        mapped,
        "the source's pages still mapped after the wait"
    );
    for (&was, &now) in ids.iter().zip(&moved) {
        holds_pattern(&tier.backend().clone(), &host, was, now);
    }
    // An alloc meanwhile is served (it may wait for blocks in transit, never refused).
    let extra = kv.alloc(1).expect("alloc during the give-back");
    kv.free(&extra).expect("free");
    kv.trim();
    assert!(
        p.stats().mapped < mapped,
        "the trim waited for the give-back"
    );
    books_hold(&b, &p);
    // Back, then out again and a sleep right after the wait: it waits for the give-back.
    let m = host.move_to(&moved, &kv).expect("onboard");
    let home = m.destinations().to_vec();
    m.wait().expect("onboard");
    let m = kv.move_to(&home, &host).expect("offload again");
    let again = m.destinations().to_vec();
    m.wait().expect("offload again");
    p.sleep(&SleepPolicy::offload_all()).expect("sleep");
    assert_eq!(p.stats().mapped, 0, "nothing left mapped by the give-back");
    p.wake(AfterWake::FreeHostMemory).expect("wake");
    // The drop of a cache joins its give-backs.
    let m = host.move_to(&again, &kv).expect("onboard again");
    let last = m.destinations().to_vec();
    m.wait().expect("onboard again");
    kv.free(&last).expect("free");
    slow.clear();
    drop((kv, host));
    books_hold(&b, &p);
    assert_eq!(p.stats().in_use, 0);
}
