//! Sleep and wake: contents byte-exact at the same addresses, charges credited, every failure
//! rolled back, refusals clean under concurrency. Generic over the backend.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use elastic_vmm::backend::testing::DelayInjector;
use elastic_vmm::backend::testing::FaultInjector;
use elastic_vmm::backend::Copies;
use elastic_vmm::{
    AfterWake, Allocation, Backend, BlockBacking, DriverCall, Error, HostStaging, MappingHook,
    MemOptions, ModelConfig, Pool, PoolConfig, SharedPool, SharedPoolConfig, SleepAction,
    SleepPolicy, SleepStatus, Tag, UniformBlocks,
};

use super::{pattern, MIB};

/// Allocations with known contents, and where they were.
struct Loaded {
    allocs: Vec<(Allocation, Vec<u8>, u64)>,
}

fn load(p: &Pool, sizes: &[usize], tag: Tag, seed: u64) -> Loaded {
    let mut allocs = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let mut a = p
            .allocate_with(n, &MemOptions::new().tag(tag.clone()))
            .expect("allocate");
        let data = pattern(seed + i as u64, n);
        a.write(0, &data).expect("write");
        let addr = a.addr();
        allocs.push((a, data, addr));
    }
    Loaded { allocs }
}

fn check(l: &Loaded, what: &str) {
    for (i, (a, data, addr)) in l.allocs.iter().enumerate() {
        assert_eq!(a.addr(), *addr, "{what}: allocation {i} moved");
        let mut out = vec![0u8; data.len()];
        a.read(0, &mut out).expect("read");
        assert!(
            out == *data,
            "{what}: allocation {i} ({} bytes) differs",
            data.len()
        );
    }
}

fn is_asleep_error(e: &Error) -> bool {
    matches!(e, Error::Asleep { .. })
}

/// Offload everything: physical memory goes, every use is refused while asleep, contents come
/// back byte-exact at the same addresses, staging is reused by the next sleep.
pub fn offload_round_trip(backend: Arc<dyn Backend>) {
    let p = Pool::new(backend.clone(), PoolConfig::new(4 << 30)).expect("pool");
    let l = load(
        &p,
        &[
            1,
            4096,
            3 * MIB as usize + 17,
            9 * MIB as usize,
            40 * MIB as usize,
        ],
        Tag::Weights,
        1,
    );
    let region = p
        .reserve_region_with(64 * MIB, &MemOptions::new().tag(Tag::Kv))
        .expect("region");
    region.map(8 * MIB, 16 * MIB).expect("map");
    let kv = pattern(99, (16 * MIB) as usize);
    // SAFETY: the range was just mapped and nothing else uses it.
    unsafe { region.write(8 * MIB, &kv) }.expect("region write");
    // Idle and cached memory that sleep gives back first.
    drop(p.allocate(20 * MIB as usize).expect("idle"));
    let before = p.stats();
    let held_before = backend.physical_bytes().expect("physical");
    assert!(held_before >= before.mapped);

    let r = p.sleep(&SleepPolicy::offload_all()).expect("sleep");
    let s = p.stats();
    assert_eq!(s.mapped, 0, "nothing stays mapped: {s:?}");
    assert_eq!(s.cached, 0);
    assert_eq!(s.in_flight, 0);
    assert!(
        s.asleep >= s.in_use,
        "asleep {} covers in use {}",
        s.asleep,
        s.in_use
    );
    assert_eq!(r.offloaded, s.asleep, "{r:?}");
    assert_eq!(r.discarded, 0);
    assert_eq!(r.released, r.offloaded);
    assert_eq!(s.host_staging, r.offloaded);
    assert_eq!(
        backend.physical_bytes().expect("physical"),
        0,
        "every chunk released"
    );
    p.audit().expect("audit asleep");
    let ss = p.sleep_stats();
    assert_eq!(ss.status, SleepStatus::Asleep);
    assert!(p.is_asleep());
    let tag_bytes = |t: &Tag| {
        ss.asleep_by_tag
            .iter()
            .find(|(x, _)| x == t)
            .map_or(0, |x| x.1)
    };
    assert_eq!(tag_bytes(&Tag::Kv), 16 * MIB);
    assert!(tag_bytes(&Tag::Weights) >= 52 * MIB);
    assert!(ss.last_sleep.is_some());

    // Refusals while asleep, each naming what and why.
    let e = p.allocate(4096).expect_err("allocate while asleep");
    assert!(is_asleep_error(&e), "{e}");
    assert!(e.to_string().contains("asleep"), "{e}");
    assert!(is_asleep_error(&p.map(0, 2 * MIB).expect_err("map")));
    assert!(is_asleep_error(
        &region.unmap(8 * MIB, 2 * MIB).expect_err("unmap")
    ));
    let mut buf = [0u8; 1];
    assert!(is_asleep_error(
        &l.allocs[0].0.read(0, &mut buf).expect_err("read")
    ));
    // SAFETY: refused before any byte is touched.
    assert!(is_asleep_error(
        &unsafe { region.read(8 * MIB, &mut buf) }.expect_err("region read")
    ));
    assert!(matches!(
        p.sleep(&SleepPolicy::offload_all()),
        Err(Error::SleepRefused { .. })
    ));
    // A free while asleep is bookkeeping only.
    let mut allocs = l.allocs;
    let (gone, _, _) = allocs.remove(1);
    drop(gone);
    let l = Loaded { allocs };

    let w = p.wake(AfterWake::KeepHostMemory).expect("wake");
    assert_eq!(w.mapped, r.offloaded);
    assert_eq!(w.restored, r.offloaded);
    check(&l, "after wake");
    let mut back = vec![0u8; kv.len()];
    // SAFETY: mapped again by the wake; nothing else uses it.
    unsafe { region.read(8 * MIB, &mut back) }.expect("region read");
    assert!(back == kv, "region contents differ after wake");
    let s = p.stats();
    assert_eq!(s.asleep, 0);
    assert_eq!(s.mapped, r.offloaded);
    assert_eq!(p.sleep_stats().status, SleepStatus::Awake);
    p.audit().expect("audit awake");
    assert!(backend.physical_bytes().expect("physical") >= s.mapped);
    assert!(matches!(
        p.wake(AfterWake::KeepHostMemory),
        Err(Error::SleepRefused { .. })
    ));

    // The second sleep reuses the staging buffer; a reserved-only sleep fits in it.
    let policy = SleepPolicy::offload_all().staging(HostStaging::Reserved);
    let r2 = p.sleep(&policy).expect("second sleep");
    assert_eq!(
        p.stats().host_staging,
        r.offloaded,
        "staging reused, not grown"
    );
    assert_eq!(r2.offloaded, r.offloaded);
    p.wake(AfterWake::FreeHostMemory).expect("second wake");
    check(&l, "after the second wake");
    assert_eq!(p.stats().host_staging, 0, "host memory freed after wake");
    // Reserved staging too small: refused, nothing changed.
    let e = p.sleep(&policy).expect_err("no staging reserved");
    assert!(matches!(e, Error::SleepRefused { .. }), "{e}");
    assert_eq!(p.sleep_stats().status, SleepStatus::Awake);
    check(&l, "after a refused sleep");
    p.reserve_host_staging(128 * MIB).expect("reserve staging");
    assert_eq!(p.stats().host_staging, 128 * MIB);
    p.sleep(&policy).expect("sleep into reserved staging");
    p.wake(AfterWake::KeepHostMemory).expect("wake");
    check(&l, "after sleeping into reserved staging");
    p.audit().expect("audit");
}

/// Weights offloaded, KV discarded: only the weights' chunks are copied; stats per tag.
pub fn mixed_tags(backend: Arc<dyn Backend>) {
    let p = Pool::new(backend.clone(), PoolConfig::new(4 << 30)).expect("pool");
    let w = load(&p, &[10 * MIB as usize, 6 * MIB as usize], Tag::Weights, 7);
    let kv = load(&p, &[8 * MIB as usize], Tag::Kv, 70);
    p.map_with(2 << 30, 8 * MIB, &MemOptions::new().tag(Tag::named("lora")))
        .expect("map");
    let policy = SleepPolicy::offload_all()
        .tag(Tag::Kv, SleepAction::Discard)
        .tag(Tag::named("lora"), SleepAction::Discard);
    assert_eq!(policy.action_for(&Tag::Kv), SleepAction::Discard);
    assert_eq!(policy.action_for(&Tag::Scratch), SleepAction::Offload);
    let r = p.sleep(&policy).expect("sleep");
    assert!(r.discarded >= 8 * MIB, "lora range discarded: {r:?}");
    assert!(
        r.offloaded >= 16 * MIB && r.offloaded < 16 * MIB + r.discarded,
        "{r:?}"
    );
    let ss = p.sleep_stats();
    let by = |t: Tag| {
        ss.asleep_by_tag
            .iter()
            .find(|(x, _)| *x == t)
            .map_or(0, |x| x.1)
    };
    assert_eq!(by(Tag::named("lora")), 8 * MIB);
    assert!(by(Tag::Kv) >= 8 * MIB);
    assert!(by(Tag::Weights) >= 16 * MIB);
    assert_eq!(ss.offloaded_bytes, r.offloaded);
    p.wake(AfterWake::KeepHostMemory).expect("wake");
    check(&w, "weights after wake");
    assert_eq!(
        kv.allocs[0].0.addr(),
        kv.allocs[0].2,
        "kv stays at its address"
    );
    assert_eq!(kv.allocs[0].0.tag(), Tag::Kv);
    assert!(p.is_mapped(2 << 30, 8 * MIB));
    p.audit().expect("audit");
    // Discard everything: nothing copied.
    let r = p.sleep(&SleepPolicy::discard_all()).expect("sleep");
    assert_eq!(r.offloaded, 0);
    assert_eq!(p.sleep_stats().offloaded_bytes, 0);
    p.wake(AfterWake::KeepHostMemory).expect("wake");
    p.audit().expect("audit");
}

/// A failure at every driver call and copy of a sleep and of a wake rolls back: awake with
/// its contents, or asleep with its host copies; books and backend agree.
pub fn failures_roll_back(backend: Arc<dyn Backend>) {
    let faults = Arc::new(FaultInjector::new(backend.clone()));
    let fb: Arc<dyn Backend> = faults.clone();
    // Small chunks so that a sleep makes several calls of each kind.
    let config = PoolConfig::new(2 << 30).max_chunk(4 * MIB as usize);
    let p = Pool::new(fb, config).expect("pool");
    let l = load(
        &p,
        &[4 * MIB as usize, 4 * MIB as usize, 8 * MIB as usize],
        Tag::Weights,
        3,
    );
    p.map_with(1 << 30, 6 * MIB, &MemOptions::new().tag(Tag::Kv))
        .expect("map");
    let policy = SleepPolicy::offload_all().tag(Tag::Kv, SleepAction::Discard);
    let settled = |what: &str| {
        p.audit().unwrap_or_else(|e| panic!("{what}: audit: {e}"));
        let s = p.stats();
        assert_eq!(s.in_flight, 0, "{what}: {s:?}");
        assert_eq!(
            backend.physical_bytes().expect("physical"),
            s.mapped + s.cached,
            "{what}: backend and pool disagree"
        );
    };
    let mut sleep_failures = 0;
    for call in [DriverCall::Unmap, DriverCall::Map, DriverCall::SetAccess] {
        for n in 1..=8 {
            faults.fail_nth(call, n);
            let r = p.sleep(&policy);
            faults.clear();
            match r {
                Err(e) => {
                    sleep_failures += 1;
                    assert!(!matches!(e, Error::Asleep { .. }), "{e}");
                    assert_eq!(
                        p.sleep_stats().status,
                        SleepStatus::Awake,
                        "{call} #{n}: {e}"
                    );
                    settled(&format!("sleep failing at {call} #{n}"));
                    check(&l, &format!("after sleep failing at {call} #{n}"));
                }
                Ok(_) => {
                    settled("asleep");
                    p.wake(AfterWake::KeepHostMemory).expect("wake");
                    check(&l, "woken");
                }
            }
        }
    }
    assert!(
        sleep_failures >= 5,
        "unmaps of a sleep failed only {sleep_failures} times"
    );
    // A failed copy during sleep.
    for n in 1..=3 {
        faults.fail_copy_nth(n);
        let r = p.sleep(&policy);
        faults.clear();
        if r.is_err() {
            assert_eq!(p.sleep_stats().status, SleepStatus::Awake);
            settled("sleep failing at a copy");
            check(&l, "after a failed sleep copy");
        } else {
            p.wake(AfterWake::KeepHostMemory).expect("wake");
        }
    }
    // A failed release during sleep: asleep all the same, the chunk cached and charged.
    faults.fail_nth(DriverCall::Release, 1);
    let r = p.sleep(&policy).expect("sleep with a failed release");
    faults.clear();
    assert!(r.kept_cached > 0, "{r:?}");
    settled("asleep with a kept chunk");
    p.wake(AfterWake::KeepHostMemory).expect("wake");
    check(&l, "after a sleep with a failed release");
    // Wake failing at each call: stays asleep, host copies intact, the next wake works.
    let mut wake_failures = 0;
    for call in [DriverCall::Create, DriverCall::Map, DriverCall::SetAccess] {
        for n in 1..=8 {
            p.sleep(&policy).expect("sleep");
            faults.fail_nth(call, n);
            let r = p.wake(AfterWake::KeepHostMemory);
            faults.clear();
            if let Err(e) = r {
                wake_failures += 1;
                assert_eq!(
                    p.sleep_stats().status,
                    SleepStatus::Asleep,
                    "{call} #{n}: {e}"
                );
                assert_eq!(p.stats().mapped, 0, "{call} #{n}: nothing stays mapped");
                settled(&format!("wake failing at {call} #{n}"));
                p.wake(AfterWake::KeepHostMemory)
                    .expect("wake after a failed wake");
            }
            check(&l, &format!("after wake failing at {call} #{n}"));
        }
    }
    assert!(
        wake_failures >= 15,
        "wake failed only {wake_failures} times"
    );
    for n in 1..=3 {
        p.sleep(&policy).expect("sleep");
        faults.fail_copy_nth(n);
        let r = p.wake(AfterWake::KeepHostMemory);
        faults.clear();
        if r.is_err() {
            assert!(p.is_asleep());
            settled("wake failing at a copy");
            p.wake(AfterWake::KeepHostMemory).expect("wake");
        }
        check(&l, "after a wake copy failure");
    }
    settled("end");
}

/// A sleep whose unmap fails and whose rollback cannot map a chunk back with access (issue 22,
/// defect 4) never leaves the pool awake over unmapped memory: the pool stays asleep with the
/// chunk kept (its contents in it, still charged), every use is refused, and a wake maps it
/// back with its contents. Two ways to get there: the remap fails (`Unmap` #2, `Map` #1), or it
/// maps but cannot grant access nor undo itself (`Unmap` #2, `SetAccess` #1, `Unmap` #3).
pub fn failed_sleep_rollback_keeps_lost_chunks_asleep(backend: Arc<dyn Backend>) {
    let faults = Arc::new(FaultInjector::new(backend.clone()));
    let fb: Arc<dyn Backend> = faults.clone();
    let config = PoolConfig::new(1 << 30).max_chunk(4 * MIB as usize);
    let p = Pool::new(fb, config).expect("pool");
    let mut l = load(&p, &[4 * MIB as usize; 3], Tag::Weights, 17);
    let scenarios: [&[(DriverCall, u64)]; 2] = [
        &[(DriverCall::Unmap, 2), (DriverCall::Map, 1)],
        &[
            (DriverCall::Unmap, 2),
            (DriverCall::SetAccess, 1),
            (DriverCall::Unmap, 3),
        ],
    ];
    for faults_armed in scenarios {
        // Nothing idle: the sleep's own trim makes no unmap, so the counts hit the sleep's.
        p.trim().expect("trim");
        for &(call, n) in faults_armed {
            faults.fail_nth(call, n);
        }
        let e = p
            .sleep(&SleepPolicy::offload_all())
            .expect_err("the sleep's unmap fails");
        faults.clear();
        let what = format!("{faults_armed:?}");
        p.audit()
            .unwrap_or_else(|a| panic!("{what}: audit after a failed sleep ({e}): {a}"));
        let st = p.sleep_stats();
        assert_eq!(
            st.status,
            SleepStatus::Asleep,
            "{what}: a chunk could not be mapped back ({e}), yet the pool is {:?} with live allocations over it",
            st.status
        );
        assert!(st.asleep_bytes >= 4 * MIB, "{what}: {st:?}");
        // Every use through the safe API is refused, none touches the memory.
        for (a, data, _) in &mut l.allocs {
            let mut out = vec![0u8; data.len()];
            let r = a.read(0, &mut out);
            assert!(matches!(r, Err(Error::Asleep { .. })), "{what}: read {r:?}");
            let r = a.write(0, data);
            assert!(
                matches!(r, Err(Error::Asleep { .. })),
                "{what}: write {r:?}"
            );
        }
        assert!(matches!(
            p.allocate(MIB as usize),
            Err(Error::Asleep { .. })
        ));
        let s = p.stats();
        assert_eq!(
            backend.physical_bytes().expect("physical"),
            s.mapped + s.cached + s.in_flight,
            "{what}: the kept chunk is still the pool's: {s:?}"
        );
        // A wake that fails keeps it asleep, the chunk kept.
        faults.fail_nth(DriverCall::Map, 1);
        p.wake(AfterWake::KeepHostMemory)
            .expect_err("the wake's first map fails");
        faults.clear();
        assert!(p.is_asleep(), "{what}: a failed wake stays asleep");
        p.audit().expect("audit after a failed wake");
        let s = p.stats();
        assert_eq!(
            backend.physical_bytes().expect("physical"),
            s.mapped + s.cached + s.in_flight,
            "{what}: after a failed wake: {s:?}"
        );
        p.wake(AfterWake::KeepHostMemory)
            .expect("wake maps the kept chunk");
        check(&l, &format!("{what}: after the wake"));
        p.audit().expect("audit after the wake");
        let s = p.stats();
        assert_eq!(s.in_flight, 0, "{what}: {s:?}");
        assert_eq!(
            backend.physical_bytes().expect("physical"),
            s.mapped + s.cached,
            "{what}: backend and pool disagree"
        );
        // The pool works as before: a full sleep and wake.
        p.sleep(&SleepPolicy::offload_all()).expect("sleep");
        p.wake(AfterWake::KeepHostMemory).expect("wake");
        check(&l, &format!("{what}: after a second round"));
    }
    // Dropped while a failed sleep keeps a chunk: everything goes back all the same.
    faults.fail_nth(DriverCall::Unmap, 2);
    faults.fail_nth(DriverCall::Map, 1);
    p.sleep(&SleepPolicy::offload_all())
        .expect_err("the sleep's unmap fails");
    faults.clear();
    assert!(p.is_asleep());
    drop(l);
    drop(p);
    assert_eq!(
        backend.physical_bytes().expect("physical"),
        0,
        "all released"
    );
}

/// KV structures are tagged `Kv` unless told otherwise (issue 22, defect 3): a sleep that
/// discards `Kv` and offloads the rest (the README's own policy) discards the memory of an
/// elastic layout, a block backing and layouts in an allocation and in a mapped region, and
/// offloads the weights and a backing explicitly tagged otherwise.
pub fn kv_structures_are_discarded_by_tag(backend: Arc<dyn Backend>) {
    use elastic_vmm::layout::{BlockDim, LayoutBuilder, LayoutConfig};
    let g = backend.info().granularity;
    let p = Pool::new(backend, PoolConfig::new(4 << 30)).expect("pool");
    let weights = load(&p, &[3 * g], Tag::Weights, 29);
    // 8 blocks, 2 layers, K and V, 16 tokens of 64 bf16 values: 4 KiB per unit.
    let config = LayoutConfig::new(8, 2, 2, 16, 64, 2);
    let elastic = LayoutBuilder::new()
        .config(config)
        .layer_separate(BlockDim::First)
        .elastic(&p, &MemOptions::new())
        .build()
        .expect("elastic layout");
    elastic.ensure_backed(0..4).expect("back blocks");
    let in_alloc = LayoutBuilder::new()
        .config(config)
        .fully_contiguous()
        .allocate(&p, &MemOptions::new())
        .build()
        .expect("layout in an allocation");
    let in_region = LayoutBuilder::new()
        .config(config)
        .fully_contiguous()
        .map_region(&p, &MemOptions::new())
        .build()
        .expect("layout in a mapped region");
    let blocks = BlockBacking::reserve(
        &p,
        UniformBlocks::packed(4, g as u64),
        &MemOptions::new(),
        None,
    )
    .expect("backing");
    blocks.ensure_backed(0..2).expect("back");
    let acts = BlockBacking::reserve(
        &p,
        UniformBlocks::packed(2, g as u64),
        &MemOptions::new().tag(Tag::Activations),
        None,
    )
    .expect("backing tagged otherwise");
    acts.ensure_backed(0..2).expect("back");
    let mapped = p.stats().mapped;
    let policy = SleepPolicy::offload_all().tag(Tag::Kv, SleepAction::Discard);
    let r = p.sleep(&policy).expect("sleep");
    let by_tag = p.sleep_stats().asleep_by_tag;
    let bytes = |t: Tag| by_tag.iter().find(|(x, _)| *x == t).map_or(0, |(_, n)| *n);
    assert_eq!(
        bytes(Tag::Scratch),
        0,
        "no KV structure is left untagged: {by_tag:?}"
    );
    assert!(bytes(Tag::Kv) > 0, "{by_tag:?}");
    assert_eq!(bytes(Tag::Activations), 2 * g as u64, "{by_tag:?}");
    assert_eq!(
        r.offloaded,
        (3 + 2) * g as u64,
        "only the weights and the backing tagged Activations are offloaded, the KV caches discarded: {r:?}, {by_tag:?}"
    );
    assert_eq!(r.offloaded + r.discarded, mapped, "{r:?}");
    p.wake(AfterWake::KeepHostMemory).expect("wake");
    check(&weights, "weights after the wake");
    drop((elastic, in_alloc, in_region, blocks, acts));
    p.audit().expect("audit");
}

/// Sleep credits the model's charge at once (another model uses the memory); waking without
/// room is refused with the numbers and the model stays asleep; once the other model's memory
/// is idle, waking takes it over (donation) and the contents are back.
pub fn wake_goes_through_admission(backend: Arc<dyn Backend>) {
    let shared =
        SharedPool::new(backend, SharedPoolConfig::new().global_limit(96 * MIB)).expect("shared");
    let a = shared
        .register(ModelConfig::new("a", 1 << 30, 96 * MIB))
        .expect("a");
    let b = shared
        .register(ModelConfig::new("b", 1 << 30, 96 * MIB))
        .expect("b");
    let l = load(
        &a,
        &[32 * MIB as usize, 30 * MIB as usize],
        Tag::Weights,
        11,
    );
    shared.audit().expect("audit");
    let used_before = a.model_stats().expect("a").used;
    assert!(used_before >= 62 * MIB);
    // B cannot fit beside A...
    assert!(b.allocate(64 * MIB as usize).is_err());
    a.sleep(&SleepPolicy::offload_all()).expect("sleep");
    let sa = a.model_stats().expect("a");
    assert_eq!(sa.used, 0, "a's charge credited: {sa:?}");
    assert!(sa.asleep >= 62 * MIB);
    shared.audit().expect("audit asleep");
    // ...and now it does.
    let mut big = b.allocate(64 * MIB as usize).expect("b uses a's memory");
    big.fill(5).expect("touch");
    let e = a.wake(AfterWake::KeepHostMemory).expect_err("no room");
    match &e {
        Error::WakeRefused {
            asked, free, limit, ..
        } => {
            assert!(*asked >= 62 * MIB, "{e}");
            assert!(*free < *asked, "{e}");
            assert_eq!(*limit, 96 * MIB, "{e}");
        }
        other => panic!("expected WakeRefused, got {other}"),
    }
    assert!(a.is_asleep());
    assert_eq!(a.model_stats().expect("a").used, 0, "nothing stays charged");
    shared.audit().expect("audit after refusal");
    // B's memory goes idle: the wake takes it over.
    drop(big);
    a.wake(AfterWake::KeepHostMemory)
        .expect("wake with donation");
    check(&l, "after a wake by donation");
    shared.audit().expect("audit awake");
}

/// Sleep, wake, allocations, frees and copies race on many threads (unmaps and maps slowed to
/// widen the windows): every refusal is a clean error, books always hold, contents survive.
pub fn concurrent_refusals(backend: Arc<dyn Backend>) {
    let slow = Arc::new(DelayInjector::new(backend));
    slow.set_delay(DriverCall::Unmap, Duration::from_micros(300));
    slow.set_delay(DriverCall::Map, Duration::from_micros(300));
    let sb: Arc<dyn Backend> = slow.clone();
    let p = Pool::new(sb, PoolConfig::new(4 << 30).max_chunk(4 * MIB as usize)).expect("pool");
    let l = Arc::new(load(
        &p,
        &[6 * MIB as usize, 2 * MIB as usize],
        Tag::Weights,
        21,
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let refused = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(5));
    let mut workers = Vec::new();
    for t in 0..4u64 {
        let (p, stop, refused, done, start) = (
            p.clone(),
            stop.clone(),
            refused.clone(),
            done.clone(),
            start.clone(),
        );
        workers.push(thread::spawn(move || {
            start.wait();
            let mut i = 0u64;
            while !stop.load(Ordering::Acquire) && i < 400 {
                i += 1;
                let size = ((t + i) % 5 + 1) as usize * MIB as usize / 2;
                match p.allocate(size) {
                    Ok(mut a) => {
                        let data = pattern(t * 1000 + i, 64);
                        match a.write(0, &data) {
                            Ok(()) => {
                                let mut out = [0u8; 64];
                                match a.read(0, &mut out) {
                                    Ok(()) => assert_eq!(&out[..], &data[..]),
                                    Err(e) => assert!(is_asleep_error(&e), "{e}"),
                                }
                                done.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                assert!(is_asleep_error(&e), "{e}");
                                refused.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Err(e) => {
                        assert!(is_asleep_error(&e), "allocate: {e}");
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                }
                if t == 0 && i % 7 == 0 {
                    match p.map((3 << 30) + (i % 4) * 8 * MIB, 2 * MIB) {
                        Ok(()) => {
                            let _ = p.unmap((3 << 30) + (i % 4) * 8 * MIB, 2 * MIB);
                        }
                        Err(e) => assert!(
                            is_asleep_error(&e) || matches!(e, Error::RangeAlreadyMapped { .. }),
                            "map: {e}"
                        ),
                    }
                }
            }
        }));
    }
    start.wait();
    let (mut slept, mut sleep_refused) = (0, 0);
    for round in 0..12 {
        match p.sleep(&SleepPolicy::offload_all()) {
            Ok(_) => {
                slept += 1;
                p.audit().expect("audit asleep");
                // A second sleeper and an early waker are refused cleanly meanwhile.
                assert!(matches!(
                    p.sleep(&SleepPolicy::offload_all()),
                    Err(Error::SleepRefused { .. })
                ));
                thread::sleep(Duration::from_millis(2));
                p.wake(AfterWake::KeepHostMemory).expect("wake");
                check(&l, &format!("round {round}"));
            }
            Err(Error::SleepRefused { reason, .. }) => {
                sleep_refused += 1;
                assert!(!reason.is_empty());
                thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("sleep failed: {e}"),
        }
        p.audit().expect("audit");
    }
    stop.store(true, Ordering::Release);
    for w in workers {
        w.join().expect("worker");
    }
    println!(
        "slept {slept}, sleep refused {sleep_refused}, ops done {}, ops refused {}",
        done.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed)
    );
    assert!(slept >= 3, "only {slept} of 12 sleeps went through");
    if p.is_asleep() {
        p.wake(AfterWake::KeepHostMemory).expect("wake");
    }
    check(&l, "end");
    p.audit().expect("audit end");
}

/// Counts what a backing's hook hears.
#[derive(Default)]
struct Hook {
    mapped: AtomicU64,
    unmapped: AtomicU64,
    /// Refuse the next mapping (as a failed NIXL registration would).
    refuse: AtomicBool,
    /// Milliseconds each mapping takes (to widen race windows), and whether one runs now.
    delay_ms: AtomicU64,
    in_mapped: AtomicBool,
}

impl MappingHook for Hook {
    fn mapped(
        &self,
        _: elastic_vmm::backing::RegionInfo<'_>,
        _: u64,
        len: u64,
    ) -> elastic_vmm::Result<()> {
        self.in_mapped.store(true, Ordering::SeqCst);
        thread::sleep(Duration::from_millis(self.delay_ms.load(Ordering::SeqCst)));
        self.in_mapped.store(false, Ordering::SeqCst);
        if self.refuse.swap(false, Ordering::SeqCst) {
            return Err(Error::InvalidArgument("hook refused on purpose".into()));
        }
        self.mapped.fetch_add(len, Ordering::SeqCst);
        Ok(())
    }
    fn unmapping(&self, _: elastic_vmm::backing::RegionInfo<'_>, _: u64, len: u64) {
        self.unmapped.fetch_add(len, Ordering::SeqCst);
    }
}

/// A block backing on a sleeping pool: pinned blocks refuse the sleep, pins are refused while
/// asleep, its hook lets go of every mapping before sleep and hears of them again after wake,
/// and the blocks' contents come back.
pub fn backing_hears_sleep(backend: Arc<dyn Backend>) {
    let p = Pool::new(backend.clone(), PoolConfig::new(4 << 30)).expect("pool");
    let hook = Arc::new(Hook::default());
    let h: Arc<dyn MappingHook> = hook.clone();
    let b = BlockBacking::reserve(
        &p,
        UniformBlocks::packed(16, 2 * MIB),
        &MemOptions::new(),
        Some(h),
    )
    .expect("backing");
    b.ensure_backed(0..4).expect("back");
    let data = pattern(5, (8 * MIB) as usize);
    // SAFETY: blocks 0..4 are backed (mapped with access) and nothing else uses them.
    unsafe { backend.copies().write(b.addr(), &data) }.expect("write");
    assert_eq!(hook.mapped.load(Ordering::SeqCst), 8 * MIB);
    let pin = b.pin(0..2, "test transfer").expect("pin");
    let e = p.sleep(&SleepPolicy::offload_all()).expect_err("pinned");
    assert!(matches!(e, Error::SleepRefused { .. }), "{e}");
    assert!(e.to_string().contains("test transfer"), "{e}");
    assert_eq!(p.sleep_stats().status, SleepStatus::Awake);
    drop(pin);
    p.sleep(&SleepPolicy::offload_all()).expect("sleep");
    assert_eq!(
        hook.unmapped.load(Ordering::SeqCst),
        8 * MIB,
        "hook let go before sleep"
    );
    let e = b.pin(0..1, "late").expect_err("pin while asleep");
    assert!(is_asleep_error(&e), "{e}");
    assert!(
        b.ensure_backed(4..5).is_err(),
        "backing more while asleep is refused"
    );
    p.wake(AfterWake::KeepHostMemory).expect("wake");
    assert_eq!(
        hook.mapped.load(Ordering::SeqCst),
        16 * MIB,
        "hook heard of the mappings again"
    );
    let mut out = vec![0u8; data.len()];
    // SAFETY: mapped again by the wake.
    unsafe { backend.copies().read(b.addr(), &mut out) }.expect("read");
    assert!(out == data, "block contents differ after wake");
    drop(b.pin(0..4, "after wake").expect("pins work again"));
    b.release(0..4).expect("release");
    p.audit().expect("audit");
}

/// `(dst, src, len, to_host)` of a queued copy.
type QueuedCopy = (usize, usize, usize, bool);

/// A backend whose staging copies really are asynchronous: each is queued and runs only when
/// a marker recorded after it is waited for, and unmapping memory a queued copy still reads or
/// writes fails the test. On the host backend copies are synchronous, so this is what shows
/// that sleep waits for each piece before unmapping its chunks, and wake before it is done.
#[derive(Debug)]
struct DeferredCopies {
    inner: Arc<dyn Backend>,
    /// Queued copies `(dst, src, len, to_host)`, addresses as integers, and markers as the
    /// number of copies ever queued when each was recorded.
    queue: parking_lot::Mutex<(Vec<QueuedCopy>, Vec<usize>)>,
    ran: AtomicU64,
    /// How long `staging_alloc` takes (as pinning does on CUDA), and whether one is running.
    staging_delay: Duration,
    in_staging_alloc: AtomicBool,
}

impl DeferredCopies {
    fn new(inner: Arc<dyn Backend>) -> Self {
        DeferredCopies {
            inner,
            queue: parking_lot::Mutex::new((Vec::new(), Vec::new())),
            ran: AtomicU64::new(0),
            staging_delay: Duration::ZERO,
            in_staging_alloc: AtomicBool::new(false),
        }
    }
}

impl Backend for DeferredCopies {
    fn info(&self) -> &elastic_vmm::BackendInfo {
        self.inner.info()
    }
    fn reserve(&self, size: usize, alignment: usize) -> elastic_vmm::Result<u64> {
        self.inner.reserve(size, alignment)
    }
    unsafe fn free_reservation(&self, base: u64, size: usize) -> elastic_vmm::Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.free_reservation(base, size) }
    }
    fn create(&self, size: usize) -> elastic_vmm::Result<elastic_vmm::PhysicalChunk> {
        self.inner.create(size)
    }
    unsafe fn release(&self, chunk: elastic_vmm::PhysicalChunk) -> elastic_vmm::Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.release(chunk) }
    }
    unsafe fn map(&self, addr: u64, chunk: elastic_vmm::PhysicalChunk) -> elastic_vmm::Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.map(addr, chunk) }
    }
    unsafe fn set_access(&self, addr: u64, size: usize) -> elastic_vmm::Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.set_access(addr, size) }
    }
    unsafe fn unmap(&self, addr: u64, size: usize) -> elastic_vmm::Result<()> {
        let (start, end) = (addr as usize, addr as usize + size);
        for &(dst, src, len, to_host) in &self.queue.lock().0 {
            let dev = if to_host { src } else { dst };
            assert!(
                dev + len <= start || end <= dev,
                "unmap of [{start:#x}, {end:#x}) while a queued copy still uses [{dev:#x}, {:#x})",
                dev + len
            );
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.unmap(addr, size) }
    }
    fn memory_info(&self) -> elastic_vmm::Result<elastic_vmm::MemoryInfo> {
        self.inner.memory_info()
    }
    fn physical_bytes(&self) -> elastic_vmm::Result<u64> {
        self.inner.physical_bytes()
    }
    fn copies(&self) -> &dyn Copies {
        self
    }
}

impl Copies for DeferredCopies {
    unsafe fn write(&self, addr: u64, data: &[u8]) -> elastic_vmm::Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.copies().write(addr, data) }
    }
    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> elastic_vmm::Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.copies().read(addr, out) }
    }
    unsafe fn fill(&self, addr: u64, len: usize, byte: u8) -> elastic_vmm::Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.copies().fill(addr, len, byte) }
    }
    fn staging_alloc(&self, bytes: usize) -> elastic_vmm::Result<*mut u8> {
        self.in_staging_alloc.store(true, Ordering::SeqCst);
        thread::sleep(self.staging_delay);
        let r = self.inner.copies().staging_alloc(bytes);
        self.in_staging_alloc.store(false, Ordering::SeqCst);
        r
    }
    unsafe fn staging_free(&self, ptr: *mut u8, bytes: usize) -> elastic_vmm::Result<()> {
        assert!(
            self.queue.lock().0.is_empty(),
            "staging freed under queued copies"
        );
        // SAFETY: forwarded contract.
        unsafe { self.inner.copies().staging_free(ptr, bytes) }
    }
    unsafe fn copy_to_host_async(
        &self,
        dst: *mut u8,
        src: u64,
        bytes: usize,
        _stream: u64,
    ) -> elastic_vmm::Result<()> {
        self.queue
            .lock()
            .0
            .push((dst as usize, src as usize, bytes, true));
        Ok(())
    }
    unsafe fn copy_from_host_async(
        &self,
        dst: u64,
        src: *const u8,
        bytes: usize,
        _stream: u64,
    ) -> elastic_vmm::Result<()> {
        self.queue
            .lock()
            .0
            .push((dst as usize, src as usize, bytes, false));
        Ok(())
    }
    unsafe fn marker_record(&self, _stream: u64) -> elastic_vmm::Result<u64> {
        let mut q = self.queue.lock();
        // Counted from the first copy ever queued (run ones included).
        let at = self.ran.load(Ordering::SeqCst) as usize + q.0.len();
        q.1.push(at);
        Ok(q.1.len() as u64 - 1)
    }
    unsafe fn marker_wait(&self, marker: u64) -> elastic_vmm::Result<()> {
        // Markers are waited in order by sleep and wake: run every copy queued before it.
        let run: Vec<QueuedCopy> = {
            let mut q = self.queue.lock();
            let upto =
                q.1[marker as usize].saturating_sub(self.ran.load(Ordering::SeqCst) as usize);
            let upto = upto.min(q.0.len());
            q.0.drain(..upto).collect()
        };
        for (dst, src, len, to_host) in run {
            self.ran.fetch_add(1, Ordering::SeqCst);
            // SAFETY: the caller of the queued copy promised both ranges stay valid until this
            // marker is waited for; `unmap` above checks the device side.
            unsafe {
                if to_host {
                    self.inner.copies().read(
                        src as u64,
                        std::slice::from_raw_parts_mut(dst as *mut u8, len),
                    )?;
                } else {
                    self.inner.copies().write(
                        dst as u64,
                        std::slice::from_raw_parts(src as *const u8, len),
                    )?;
                }
            }
        }
        Ok(())
    }
}

/// Sleep and wake over truly asynchronous copies: no chunk is unmapped under a queued copy,
/// and the contents are exact (so every copy ran after its map and before its unmap).
pub fn async_copies_are_waited_for(backend: Arc<dyn Backend>) {
    let deferred: Arc<dyn Backend> = Arc::new(DeferredCopies::new(backend));
    // One-granule chunks: a 256 MiB piece holds many chunks, the first unmapped long before
    // the piece's end.
    let g = deferred.info().granularity;
    let p = Pool::new(deferred, PoolConfig::new(8 << 30).max_chunk(g)).expect("pool");
    let l = load(
        &p,
        &[40 * MIB as usize, 300 * MIB as usize],
        Tag::Weights,
        31,
    );
    for round in 0..2 {
        let r = p.sleep(&SleepPolicy::offload_all()).expect("sleep");
        assert!(r.chunks > 100, "{r:?}");
        p.wake(AfterWake::KeepHostMemory).expect("wake");
        check(&l, &format!("round {round}"));
    }
    p.audit().expect("audit");
}

/// Reserving host staging takes long (pinning: ~0.6 s per GiB on CUDA; widened here with a
/// slow `staging_alloc`): allocations, writes and maps go on meanwhile, a sleep is refused
/// cleanly until it is done, and then sleeps into the reserved buffer.
pub fn reserving_staging_does_not_block(backend: Arc<dyn Backend>) {
    let mut slow = DeferredCopies::new(backend);
    slow.staging_delay = Duration::from_millis(300);
    let slow = Arc::new(slow);
    let sb: Arc<dyn Backend> = slow.clone();
    let p = Pool::new(sb, PoolConfig::new(4 << 30)).expect("pool");
    let l = load(&p, &[8 * MIB as usize], Tag::Weights, 41);
    let reserver = {
        let p = p.clone();
        thread::spawn(move || p.reserve_host_staging(32 * MIB))
    };
    let t0 = std::time::Instant::now();
    while !slow.in_staging_alloc.load(Ordering::SeqCst) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the reservation never started"
        );
        thread::yield_now();
    }
    // Mid-reservation: the pool works, a sleep is refused, nothing changes.
    let mut a = p
        .allocate_with(2 * MIB as usize, &MemOptions::new().tag(Tag::Kv))
        .expect("allocate while pinning");
    a.fill(9).expect("write while pinning");
    p.map(1 << 30, 2 * MIB).expect("map while pinning");
    let e = p
        .sleep(&SleepPolicy::offload_all())
        .expect_err("sleep while pinning");
    assert!(
        matches!(&e, Error::SleepRefused { reason, .. } if reason.contains("being reserved")),
        "{e}"
    );
    assert!(
        slow.in_staging_alloc.load(Ordering::SeqCst),
        "the window closed too early"
    );
    reserver.join().expect("reserver").expect("reserve");
    assert_eq!(p.stats().host_staging, 32 * MIB);
    let policy = SleepPolicy::offload_all().staging(HostStaging::Reserved);
    p.sleep(&policy).expect("sleep into the reserved staging");
    p.wake(AfterWake::KeepHostMemory).expect("wake");
    check(&l, "after sleeping into reserved staging");
    p.audit().expect("audit");
}

/// A trim racing a wake that is undone (its hook refuses, slowly): the trim must not take the
/// idle chunks the wake just mapped, or the undo would unmap them twice. Books hold, the pool
/// stays asleep, and the next wake brings the contents back.
pub fn trim_during_undone_wake(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity;
    let p = Pool::new(backend, PoolConfig::new(4 << 30).max_chunk(g)).expect("pool");
    let hook = Arc::new(Hook::default());
    let h: Arc<dyn MappingHook> = hook.clone();
    let b = BlockBacking::reserve(
        &p,
        UniformBlocks::packed(4, g as u64),
        &MemOptions::new(),
        Some(h),
    )
    .expect("backing");
    b.ensure_backed(0..2).expect("back");
    let keep = load(&p, &[g, g], Tag::Weights, 51);
    let gone = p.allocate(g).expect("allocate");
    p.sleep(&SleepPolicy::offload_all()).expect("sleep");
    // Freed while asleep: its chunk wakes as wholly idle memory, what trim takes.
    drop(gone);
    hook.delay_ms.store(300, Ordering::SeqCst);
    hook.refuse.store(true, Ordering::SeqCst);
    let waker = {
        let p = p.clone();
        thread::spawn(move || p.wake(AfterWake::KeepHostMemory))
    };
    let t0 = std::time::Instant::now();
    while !hook.in_mapped.load(Ordering::SeqCst) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the wake never reached its hook"
        );
        thread::yield_now();
    }
    let trimmed = p.trim().expect("trim during the wake");
    assert_eq!(
        trimmed.unmapped, 0,
        "idle chunks of a waking pool stay put: {trimmed:?}"
    );
    assert!(
        hook.in_mapped.load(Ordering::SeqCst),
        "the window closed too early"
    );
    let e = waker.join().expect("waker").expect_err("hook refused");
    assert!(e.to_string().contains("on purpose"), "{e}");
    assert!(p.is_asleep());
    p.audit().expect("audit after the undone wake");
    hook.delay_ms.store(0, Ordering::SeqCst);
    p.wake(AfterWake::KeepHostMemory).expect("wake");
    check(&keep, "after the undone wake");
    p.trim().expect("trim when awake");
    p.audit().expect("audit");
}

/// A failed wake whose own rollback cannot unmap a chunk (`Map` #2, then `Unmap` #1) keeps that
/// chunk in the asleep slot it lies in: trim never releases it into the free address space
/// while allocations still own the addresses (found with defect 4 of issue 22: it was kept as
/// "stuck", and trim handed its range to the free space, under live allocations).
pub fn failed_wake_rollback_keeps_addresses_owned(backend: Arc<dyn Backend>) {
    let faults = Arc::new(FaultInjector::new(backend.clone()));
    let fb: Arc<dyn Backend> = faults.clone();
    let config = PoolConfig::new(1 << 30).max_chunk(4 * MIB as usize);
    let p = Pool::new(fb, config).expect("pool");
    let l = load(&p, &[4 * MIB as usize; 3], Tag::Weights, 23);
    p.trim().expect("trim");
    for (what, second) in [
        ("offloaded", SleepPolicy::offload_all()),
        ("discarded", SleepPolicy::discard_all()),
    ] {
        p.sleep(&second).expect("sleep");
        faults.fail_nth(DriverCall::Map, 2);
        faults.fail_nth(DriverCall::Unmap, 1);
        let e = p
            .wake(AfterWake::KeepHostMemory)
            .expect_err("the wake's second map fails");
        faults.clear();
        assert!(p.is_asleep(), "{what}: {e}");
        p.audit()
            .unwrap_or_else(|a| panic!("{what}: audit after the undone wake ({e}): {a}"));
        p.trim().expect("trim while asleep");
        p.audit()
            .unwrap_or_else(|a| panic!("{what}: audit after trim: {a}"));
        let s = p.stats();
        assert_eq!(
            backend.physical_bytes().expect("physical"),
            s.mapped + s.cached + s.in_flight,
            "{what}: {s:?}"
        );
        p.wake(AfterWake::KeepHostMemory).expect("wake");
        p.audit().expect("audit after the wake");
        assert_eq!(p.stats().in_flight, 0);
        if what == "offloaded" {
            check(&l, "after the wake");
        }
        // Fresh allocations never land on the live ones.
        let extra = p.allocate(4 * MIB as usize).expect("allocate");
        for (a, _, _) in &l.allocs {
            let (s, e) = (a.offset(), a.offset() + a.footprint());
            assert!(
                extra.offset() + extra.footprint() <= s || e <= extra.offset(),
                "{what}: a new allocation at {:#x} lies on a live one at {s:#x}",
                extra.offset()
            );
        }
    }
    drop(l);
    drop(p);
    assert_eq!(
        backend.physical_bytes().expect("physical"),
        0,
        "all released"
    );
}
