//! The shared pool's behavioural suite on the host backend (real memory).

#[path = "suite/mod.rs"]
mod suite;

use std::sync::Arc;

use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::Backend;

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new(2 << 20).expect("host backend"))
}

crate::shared_suite!(host);

#[test]
fn concurrent_models() {
    suite::shared::concurrent_models(host(), 8, 4, 10, 300);
}

#[test]
fn hand_over() {
    let secs = suite::shared::hand_over(host(), 256 << 20, 16 << 20);
    println!("hand-over of 256 MiB on the host: {:.1} ms", secs * 1e3);
}

#[test]
fn a_lowered_limit_stays_at_least_the_guarantee() {
    suite::shared::a_lowered_limit_stays_at_least_the_guarantee(host());
}

/// A model of 16 granules in a shared pool on the host backend, with a small KV cache (whose
/// zero page it makes) and one block allocated: the zero-page tests' start.
struct ZeroPageCase {
    backend: Arc<dyn Backend>,
    g: u64,
    shared: elastic_vmm::SharedPool,
    m: elastic_vmm::ModelHandle,
    kv: elastic_vmm::kv::PagedKv,
    ids: Vec<elastic_vmm::kv::BlockId>,
}

fn zero_page_case() -> ZeroPageCase {
    use elastic_vmm::kv::{PagedKv, PagedKvConfig};
    use elastic_vmm::{ModelConfig, SharedPool, SharedPoolConfig};
    let backend = host();
    let g = 2u64 << 20;
    let shared = SharedPool::new(backend.clone(), SharedPoolConfig::new()).expect("shared");
    let m = shared
        .register(ModelConfig::new("m", (64 * g) as usize, 16 * g))
        .expect("model");
    let kv = PagedKv::new(&m, PagedKvConfig::new(1, 2, 64, 4096, 2, 16)).expect("cache");
    let ids = kv.alloc(1).expect("alloc");
    ZeroPageCase {
        backend,
        g,
        shared,
        m,
        kv,
        ids,
    }
}

/// Issue 33, defect 8: the zero page is real memory (one granule per pool with a zero-filled
/// region, e.g. a KV cache); the ledger must count what the backend holds for its models, as
/// a broker does for an engine's pool (every chunk it creates, the zero page included).
#[test]
fn the_ledger_counts_the_zero_page() {
    let ZeroPageCase {
        backend,
        g,
        shared,
        m,
        kv,
        ids,
    } = zero_page_case();
    let pool = m.stats();
    assert_eq!(pool.zero_page, g, "the pool made its zero page");
    let ledger = shared.stats().global.used;
    let held = backend.physical_bytes().expect("physical");
    assert_eq!(
        ledger, held,
        "ledger says {ledger} bytes, the backend holds {held} (pool: mapped {} cached {} zero page {})",
        pool.mapped, pool.cached, pool.zero_page
    );
    kv.free(&ids).expect("free");
    shared.audit().expect("audit");
}

/// Issue 33, defect 8: the zero page's charge goes with the last zero-filled region. Dropping
/// the cache (its region) releases the zero page and credits the ledger: after a trim of the
/// cached chunks the ledger is back to 0 and the backend holds nothing.
#[test]
fn the_zero_page_charge_goes_with_the_cache() {
    let ZeroPageCase {
        backend,
        g,
        shared,
        m,
        kv,
        ids,
    } = zero_page_case();
    let held = backend.physical_bytes().expect("physical");
    assert_eq!(
        shared.stats().global.used,
        held,
        "charged while the cache lives"
    );
    assert_eq!(m.stats().physical(), held, "the pool counts its zero page");
    kv.free(&ids).expect("free");
    drop(kv);
    let s = m.stats();
    assert_eq!(
        s.zero_page, 0,
        "the last zero-filled region took the zero page with it"
    );
    assert_eq!(s.zero_aliased, 0);
    m.trim().expect("trim");
    shared.audit().expect("audit");
    assert_eq!(shared.stats().global.used, 0, "nothing charged");
    assert_eq!(
        backend.physical_bytes().expect("physical"),
        0,
        "nothing held"
    );
    assert_eq!(m.stats().physical(), 0);
    assert!(
        m.stats().peak_physical >= held,
        "the peak saw the zero page: {} < {held}",
        m.stats().peak_physical
    );
    // A new cache makes (and charges) a zero page again.
    let kv = elastic_vmm::kv::PagedKv::new(
        &m,
        elastic_vmm::kv::PagedKvConfig::new(1, 2, 64, 4096, 2, 16),
    )
    .expect("cache again");
    assert_eq!(m.stats().zero_page, g);
    shared.audit().expect("audit");
    drop(kv);
    drop(m);
    assert_eq!(
        shared.stats().global.used,
        0,
        "nothing charged once the model is gone"
    );
    assert_eq!(backend.physical_bytes().expect("physical"), 0);
}

/// Issue 33, defect 8: a model's limit counts the zero page. A cache whose model has no room
/// for it is refused with the limit's numbers, and nothing is left behind: no region, no
/// charge, no memory; with the room it is made.
#[test]
fn a_limit_without_room_for_the_zero_page_refuses_the_cache() {
    use elastic_vmm::kv::{PagedKv, PagedKvConfig};
    use elastic_vmm::{Error, ModelConfig, Pool, PoolConfig, SharedPool, SharedPoolConfig};
    let backend = host();
    let g = 2u64 << 20;
    let shared = SharedPool::new(backend.clone(), SharedPoolConfig::new()).expect("shared");
    let m = shared
        .register(ModelConfig::new("m", (64 * g) as usize, g / 2))
        .expect("model");
    let e = PagedKv::new(&m, PagedKvConfig::new(1, 2, 64, 4096, 2, 16))
        .expect_err("no room for the zero page");
    assert!(
        matches!(e, Error::AdmissionRefused { requested, model_limit, .. } if requested == g && model_limit == g / 2),
        "{e}"
    );
    let s = m.stats();
    assert_eq!(
        (s.zero_page, s.reserved_regions, s.physical()),
        (0, 0, 0),
        "{s:?}"
    );
    assert_eq!(shared.stats().global.used, 0, "nothing charged");
    assert_eq!(
        backend.physical_bytes().expect("physical"),
        0,
        "nothing held"
    );
    m.audit().expect("pool audit");
    shared.audit().expect("audit");
    // One granule is room enough: the cache's only memory until blocks are allocated.
    shared.set_limit("m", g).expect("raise the limit");
    let kv = PagedKv::new(&m, PagedKvConfig::new(1, 2, 64, 4096, 2, 16)).expect("cache");
    assert_eq!(shared.stats().global.used, g, "the zero page");
    assert_eq!(m.stats().zero_page, g);
    shared.audit().expect("audit");
    drop(kv);
    // A plain pool's physical limit counts it too, and its refusal names it.
    let p = Pool::new(
        backend.clone(),
        PoolConfig::new((16 * g) as usize).physical_limit(g / 2),
    )
    .expect("pool");
    let e = PagedKv::new(&p, PagedKvConfig::new(1, 2, 64, 4096, 2, 16))
        .expect_err("no room for the zero page");
    assert!(
        matches!(&e, Error::OutOfPhysicalMemory { requested, .. } if *requested == g)
            && e.to_string().contains("zero page"),
        "{e}"
    );
    let s = p.stats();
    assert_eq!(
        (s.zero_page, s.reserved_regions, s.physical()),
        (0, 0, 0),
        "{s:?}"
    );
    p.audit().expect("pool audit");
}

/// Model b (2 MiB granules, a 4-granule budget) holds 2 granules written 0x11 and sleeps
/// dropping them; model a then takes the whole budget a granule at a time, writes it 0x5A and
/// frees it: its idle cache holds it, in chunks b's wake can take. The wake tests' start.
struct WakeOverACache {
    g: usize,
    _shared: elastic_vmm::SharedPool,
    a: elastic_vmm::ModelHandle,
    b: elastic_vmm::ModelHandle,
    mine: elastic_vmm::Allocation,
}

fn wake_over_a_cache(backend: Arc<dyn Backend>) -> WakeOverACache {
    use elastic_vmm::{MemOptions, ModelConfig, SharedPool, SharedPoolConfig};
    use elastic_vmm::{SleepPolicy, Tag};
    let g = 2usize << 20;
    let shared = SharedPool::new(backend, SharedPoolConfig::new().global_limit(4 * g as u64))
        .expect("shared");
    let cfg = |n: &str| ModelConfig::new(n, 16 * g, 4 * g as u64);
    let a = shared.register(cfg("a")).expect("a");
    let b = shared.register(cfg("b")).expect("b");
    let kv = MemOptions::new().tag(Tag::Kv);
    let mut mine = b.allocate_with(2 * g, &kv).expect("b's allocation");
    mine.fill(0x11).expect("fill");
    b.sleep(&SleepPolicy::discard_all()).expect("sleep");
    let theirs: Vec<_> = (0..4)
        .map(|_| {
            let mut x = a.allocate_with(g, &kv).expect("a's allocation");
            x.fill(0x5A).expect("fill");
            x
        })
        .collect();
    drop(theirs);
    WakeOverACache {
        g,
        _shared: shared,
        a,
        b,
        mine,
    }
}

/// Bytes of `mine` that are not zero, and of those the other model's (0x5A).
fn stale_bytes(mine: &elastic_vmm::Allocation) -> (usize, usize) {
    let mut buf = vec![0u8; mine.size()];
    mine.read(0, &mut buf).expect("read");
    (
        buf.iter().filter(|&&x| x != 0).count(),
        buf.iter().filter(|&&x| x == 0x5A).count(),
    )
}

/// Issue 33, defect 3 at a wake: a model that slept dropping its data gets fresh physical
/// memory at its wake, and when the budget is full that memory is another model's idle
/// cache. Its bytes must not come with it: the woken allocation reads zeros, not the other
/// model's data.
#[test]
fn a_wake_over_another_models_memory_reads_no_stale_bytes() {
    // Bound whole: the shared pool and model a live to the end.
    let c = wake_over_a_cache(host());
    let (g, a, b, mine) = (c.g, &c.a, &c.b, &c.mine);
    b.wake(elastic_vmm::AfterWake::FreeHostMemory)
        .expect("wake over a's idle memory");
    let got = b.model_stats().expect("b");
    assert_eq!(got.mapped, 2 * g as u64, "{got:?}");
    assert!(
        a.model_stats().expect("a").reclaimed < 4 * g as u64,
        "a's chunks were handed over, not released: {:?}",
        a.model_stats()
    );
    let (stale, theirs) = stale_bytes(mine);
    assert_eq!(
        stale,
        0,
        "{stale} of {} bytes of b's woken allocation are not zero (a's bytes: {theirs})",
        mine.size()
    );
}

/// The same after a failed wake whose rollback could not unmap a chunk it took from model a
/// (`Map` #2 fails, then `Unmap` #3): the chunk stays in b's asleep slot, and the next wake
/// must not take it as b's own clean memory.
#[test]
fn a_chunk_kept_by_a_failed_wake_is_cleared_at_the_next() {
    use elastic_vmm::backend::testing::FaultInjector;
    use elastic_vmm::backend::DriverCall;
    use elastic_vmm::AfterWake;
    let faults = Arc::new(FaultInjector::new(host()));
    let c = wake_over_a_cache(faults.clone());
    let (g, b, mine) = (c.g, &c.b, &c.mine);
    // As on CUDA, the chunks taken from a can be cleared only once mapped: the wake fails
    // before that, and its rollback keeps one of them (the third unmap: the first two give
    // a's idle chunks up).
    faults.refuse_wipes();
    faults.fail_nth(DriverCall::Map, 2);
    faults.fail_nth(DriverCall::Unmap, 3);
    b.wake(AfterWake::FreeHostMemory)
        .expect_err("the wake's second map fails");
    faults.clear();
    assert_eq!(
        b.stats().in_flight,
        g as u64,
        "one of a's chunks kept in b's slot"
    );
    b.wake(AfterWake::FreeHostMemory).expect("wake");
    let (stale, _) = stale_bytes(mine);
    assert_eq!(
        stale, 0,
        "{stale} bytes of b's woken allocation are not zero"
    );
}
