//! Regions and elastic block backing, generic over the backend (host in CI, CUDA on the GPU).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

use elastic_vmm::backend::fault::FaultInjector;
use elastic_vmm::backing::RegionInfo;
use elastic_vmm::{
    Backend, BlockBacking, BlockGeometry, DriverCall, Error, MappingHook, ModelConfig, Pool,
    PoolConfig, SharedPool, SharedPoolConfig, UniformBlocks,
};
use parking_lot::Mutex;

use super::{Rng, GIB};

fn pool(backend: &Arc<dyn Backend>, capacity: u64) -> Pool {
    Pool::new(
        backend.clone(),
        PoolConfig::new(capacity as usize).growth_divisor(0),
    )
    .expect("pool")
}

fn held_matches(backend: &Arc<dyn Backend>, p: &Pool) {
    let s = p.stats();
    assert_eq!(
        backend.physical_bytes().expect("physical"),
        s.mapped + s.cached,
        "backend holds what the pool says"
    );
    p.audit().expect("audit");
}

/// A region is out of the allocator's and the pool range API's reach, maps and unmaps its own
/// granules, refuses bad ranges with their numbers, and gives everything back when dropped.
pub fn region_is_set_apart(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(&backend, 64 * g);
    let r = p.reserve_region(16 * g - 1).expect("region");
    assert_eq!(r.len(), 16 * g, "rounded up to the granularity");
    assert_eq!(p.stats().reserved_regions, 16 * g);
    let (rs, re) = (r.offset(), r.offset() + r.len());
    // The allocator fills the rest of the address space and never lands in the region.
    let mut live = Vec::new();
    loop {
        match p.allocate(g as usize) {
            Ok(a) => live.push(a),
            Err(Error::OutOfAddressSpace { .. }) => break,
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    assert_eq!(live.len() as u64, 48, "48 granules outside the region");
    for a in &live {
        assert!(
            a.offset() + a.footprint() <= rs || a.offset() >= re,
            "allocation at {:#x} lies in the region [{rs:#x}, {re:#x})",
            a.offset()
        );
    }
    drop(live);
    p.trim().expect("trim");
    // The pool's own range API keeps out too.
    assert!(matches!(p.map(rs, g), Err(Error::RangeInUse { .. })));
    r.map(2 * g, 3 * g).expect("region map");
    assert!(r.is_mapped(2 * g, 3 * g) && !r.is_mapped(g, g));
    assert!(matches!(
        p.unmap(rs + 2 * g, g),
        Err(Error::RangeInUse { .. })
    ));
    assert_eq!(r.mapped_bytes(), 3 * g);
    assert_eq!(r.chunks_in(0, r.len()).len(), 3, "one chunk per granule");
    match r.map(15 * g, 2 * g) {
        Err(Error::RangeOutOfBounds {
            offset,
            len,
            capacity,
        }) => assert_eq!((offset, len, capacity), (15 * g, 2 * g, 16 * g)),
        other => panic!("expected RangeOutOfBounds, got {other:?}"),
    }
    assert!(matches!(
        r.map(3 * g, g),
        Err(Error::RangeAlreadyMapped { .. })
    ));
    assert!(matches!(
        r.unmap(8 * g, g),
        Err(Error::RangeNotMapped { .. })
    ));
    assert!(matches!(r.map(g / 2, g), Err(Error::Misaligned { .. })));
    r.unmap(3 * g, g).expect("unmap one granule");
    assert!(r.is_mapped(2 * g, g) && !r.is_mapped(3 * g, g) && r.is_mapped(4 * g, g));
    held_matches(&backend, &p);
    // Data lives in the region's memory.
    let mut addr_check = p.allocate(g as usize).expect("outside");
    addr_check.write(0, b"x").expect("write");
    drop(addr_check);
    drop(r);
    assert_eq!(p.stats().reserved_regions, 0);
    assert_eq!(
        p.stats().range_mapped,
        0,
        "the region unmapped what it held"
    );
    held_matches(&backend, &p);
    // Its address space is the allocator's again.
    let all: Vec<_> = (0..64)
        .map(|_| p.allocate(g as usize).expect("all"))
        .collect();
    drop(all);
    assert!(matches!(p.reserve_region(0), Err(Error::ZeroSize { .. })));
    match p.reserve_region(65 * g) {
        Err(Error::OutOfAddressSpace {
            requested,
            capacity,
            ..
        }) => assert_eq!((requested, capacity), (65 * g, 64 * g)),
        other => panic!("expected OutOfAddressSpace, got {other:?}"),
    }
    p.trim().expect("trim");
    assert_eq!(backend.physical_bytes().expect("held"), 0);
}

/// Records every hook call, and checks at each one that the memory is mapped (a registration
/// is made after the mapping and dropped before the unmapping).
#[derive(Default)]
struct Recorder {
    events: Mutex<Vec<(&'static str, u64, u64)>>,
    fail_next: AtomicBool,
}

impl MappingHook for Recorder {
    fn mapped(&self, region: RegionInfo<'_>, at: u64, len: u64) -> elastic_vmm::Result<()> {
        assert!(region.is_mapped(at, len), "hook told of unmapped memory");
        if self.fail_next.swap(false, Ordering::SeqCst) {
            return Err(Error::InvalidArgument("hook refused".into()));
        }
        self.events.lock().push(("mapped", at, len));
        Ok(())
    }

    fn unmapping(&self, region: RegionInfo<'_>, at: u64, len: u64) {
        assert!(
            region.is_mapped(at, len),
            "hook told of an unmapping after it happened"
        );
        self.events.lock().push(("unmapping", at, len));
    }
}

impl Recorder {
    /// Bytes the hook believes are mapped now.
    fn live_bytes(&self) -> i64 {
        self.events
            .lock()
            .iter()
            .map(|&(k, _, len)| {
                if k == "mapped" {
                    len as i64
                } else {
                    -(len as i64)
                }
            })
            .sum()
    }
}

/// Pages shared by several blocks are mapped once and unmapped when the last block on them is
/// released; blocks spanning pages map all of them; costs are counted per page.
pub fn backing_shares_pages(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(&backend, 64 * g);
    // Quarter-page blocks: four per page.
    let hook = Arc::new(Recorder::default());
    let small = BlockBacking::new(
        p.reserve_region(8 * g).expect("region"),
        UniformBlocks::packed(32, g / 4),
        None,
        Some(hook.clone()),
    )
    .expect("backing");
    assert_eq!(small.ensure_backed([0]).expect("b0").bytes, g);
    assert_eq!(
        small.ensure_backed([1, 2]).expect("b1,b2").bytes,
        0,
        "same page"
    );
    assert_eq!(
        small.ensure_backed([0, 1]).expect("again").blocks,
        0,
        "idempotent"
    );
    assert_eq!(
        small.physical_bytes_for([0, 1, 2, 3, 4]).expect("cost"),
        2 * g
    );
    assert_eq!(
        small.additional_bytes_for([0, 1, 2, 3, 4]).expect("extra"),
        g
    );
    assert_eq!(
        small.release([0, 2]).expect("release").bytes,
        0,
        "block 1 holds the page"
    );
    assert!(small.is_range_mapped(0, g));
    assert_eq!(small.release([1]).expect("last").bytes, g);
    assert!(!small.is_range_mapped(0, 1));
    match small.release([1]) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("block 1 is not backed"), "{m}"),
        other => panic!("double release must fail, got {other:?}"),
    }
    match small.ensure_backed([31, 32]) {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains("block 32") && m.contains("32 blocks"), "{m}")
        }
        other => panic!("expected a bad block index error, got {other:?}"),
    }
    assert_eq!(small.stats().mapped_pages, 0, "a refused call maps nothing");
    assert_eq!(
        *hook.events.lock(),
        vec![("mapped", 0, g), ("unmapping", 0, g)]
    );

    // 1.5-page blocks: block 0 = pages 0-1, block 1 = pages 1-2.
    let big = BlockBacking::new(
        p.reserve_region(16 * g).expect("region"),
        UniformBlocks::packed(8, 3 * g / 2),
        None,
        None,
    )
    .expect("backing");
    assert_eq!(big.ensure_backed([0]).expect("b0").bytes, 2 * g);
    assert_eq!(big.ensure_backed([1]).expect("b1").bytes, g);
    // Data written across the page boundary of block 1 survives the release of block 0.
    let data: Vec<u8> = (0..3 * g / 2).map(|i| (i % 251) as u8).collect();
    // SAFETY: block 1 is backed and nothing else touches the region.
    unsafe { big.write(3 * g / 2, &data) }.expect("write block 1");
    assert_eq!(
        big.release([0]).expect("r0").bytes,
        g,
        "page 1 stays for block 1"
    );
    assert!(big.is_range_mapped(g, 2 * g) && !big.is_range_mapped(0, g));
    let mut back = vec![0u8; data.len()];
    // SAFETY: as above.
    unsafe { big.read(3 * g / 2, &mut back) }.expect("read block 1");
    assert!(back == data, "block 1's data changed when block 0 went");
    // SAFETY: page 0 is unmapped now: the call must refuse, not touch it.
    assert!(matches!(
        unsafe { big.read(0, &mut back[..16]) },
        Err(Error::RangeNotMapped { .. })
    ));
    assert_eq!(
        p.stats().range_mapped,
        2 * g,
        "pool sees the backing's pages"
    );
    drop(big);
    drop(small);
    assert_eq!(p.stats().range_mapped, 0);
    held_matches(&backend, &p);
}

/// A driver failure, a refused admission or a failing hook in the middle of `ensure_backed`
/// leaves everything as it was: nothing mapped, nothing charged, no hook registration left.
pub fn backing_rolls_back(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let faulty = Arc::new(FaultInjector::new(backend.clone()));
    let as_backend: Arc<dyn Backend> = faulty.clone();
    let p = pool(&as_backend, 64 * g);
    let hook = Arc::new(Recorder::default());
    let b = BlockBacking::new(
        p.reserve_region(32 * g).expect("region"),
        UniformBlocks::packed(16, 2 * g),
        None,
        Some(hook.clone()),
    )
    .expect("backing");
    b.ensure_backed([0]).expect("baseline");
    let before = (p.stats().mapped, backend.physical_bytes().expect("held"));
    let check = |what: &str| {
        assert_eq!(
            (p.stats().mapped, backend.physical_bytes().expect("held")),
            before,
            "{what}: memory changed"
        );
        assert_eq!(b.stats().backed_blocks, 1, "{what}");
        assert_eq!(b.stats().mapped_pages, 2, "{what}");
        assert!(!b.is_backed(3) && !b.is_backed(7), "{what}");
        assert_eq!(
            hook.live_bytes(),
            2 * g as i64,
            "{what}: hook registrations leaked"
        );
        p.audit().expect(what);
    };
    // Blocks 3 and 7 are two separate runs: fail in the second one.
    for (call, n, what) in [
        (DriverCall::Map, 3, "third map"),
        (DriverCall::SetAccess, 2, "second access grant"),
        (DriverCall::Create, 4, "fourth create"),
    ] {
        faulty.fail_nth(call, n);
        match b.ensure_backed([3, 7]) {
            Err(Error::Backend { code, .. }) => assert_eq!(code, "FAULT_INJECTED", "{what}"),
            other => panic!("{what}: expected the injected failure, got {other:?}"),
        }
        p.trim().expect("trim cache");
        check(what);
    }
    hook.fail_next.store(true, Ordering::SeqCst);
    assert!(
        b.ensure_backed([3, 7]).is_err(),
        "hook failure fails the call"
    );
    p.trim().expect("trim cache");
    check("hook failure");
    // A failed unmap keeps the page mapped and registered; a later call gives it back.
    b.ensure_backed([5]).expect("b5");
    faulty.fail_nth(DriverCall::Unmap, 1);
    let change = b.release([5]).expect("release reports");
    assert_eq!((change.bytes, change.left_mapped), (0, 2 * g));
    assert_eq!(b.stats().mapped_pages, 4, "the pages stayed mapped");
    assert_eq!(hook.live_bytes(), 4 * g as i64, "and registered");
    assert_eq!(b.unmap_unused(), 2 * g);
    assert_eq!(hook.live_bytes(), 2 * g as i64);
    // Everything still works.
    b.ensure_backed([3, 7]).expect("after failures");
    drop(b);
    assert_eq!(
        hook.live_bytes(),
        0,
        "drop lets the hook go of everything first"
    );
    p.trim().expect("trim");
    assert_eq!(backend.physical_bytes().expect("held"), 0);
}

/// Under a model's limit, backing that would overshoot is refused before any driver call and
/// leaves nothing charged.
pub fn backing_respects_model_limits(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let s = SharedPool::new(
        backend.clone(),
        SharedPoolConfig::new().global_limit(16 * g),
    )
    .expect("shared");
    let m = s
        .register(ModelConfig::new("kv", (64 * g) as usize, 5 * g))
        .expect("model");
    let b = BlockBacking::new(
        m.reserve_region(32 * g).expect("region"),
        UniformBlocks::packed(32, g),
        None,
        None,
    )
    .expect("backing");
    b.ensure_backed(0..4).expect("four pages");
    match b.ensure_backed(4..6) {
        Err(Error::AdmissionRefused {
            model,
            requested,
            model_used,
            model_limit,
            ..
        }) => {
            assert_eq!(model, "kv");
            assert_eq!((requested, model_used, model_limit), (2 * g, 4 * g, 5 * g));
        }
        other => panic!("expected AdmissionRefused, got {other:?}"),
    }
    assert_eq!(b.stats().backed_blocks, 4);
    assert_eq!(
        s.stats().models[0].used,
        4 * g,
        "nothing charged by the refusal"
    );
    b.release(0..2).expect("release");
    b.ensure_backed(4..6)
        .expect("fits now (cached chunks reused)");
    s.audit().expect("audit");
    drop(b);
    m.trim().expect("trim");
    assert_eq!(s.stats().models[0].used, 0);
}

/// Threads back and release random blocks that share pages; a page is mapped exactly when a
/// backed block touches it, at every pause and at the end.
pub fn backing_concurrent(backend: Arc<dyn Backend>) {
    const THREADS: usize = 6;
    let g = backend.info().granularity as u64;
    let p = pool(&backend, 4 * GIB.max(256 * g));
    // 96 blocks of 2/3 page: neighbours share pages.
    let geometry = UniformBlocks::packed(96, 2 * g / 3 / 512 * 512);
    let b = Arc::new(
        BlockBacking::new(
            p.reserve_region(geometry.extent().expect("extent"))
                .expect("region"),
            geometry,
            None,
            None,
        )
        .expect("backing"),
    );
    let owned: Arc<Vec<Mutex<bool>>> = Arc::new((0..96).map(|_| Mutex::new(false)).collect());
    let check = |b: &BlockBacking<UniformBlocks>| {
        let geo = *b.geometry();
        let mut want = std::collections::BTreeSet::new();
        let mut spans = Vec::new();
        for blk in 0..geo.num_blocks {
            if b.is_backed(blk) {
                spans.clear();
                geo.block_spans(blk, &mut spans);
                for &(at, len) in &spans {
                    want.extend(at / g..=(at + len - 1) / g);
                }
            }
        }
        assert_eq!(
            b.stats().mapped_pages,
            want.len(),
            "mapped pages == pages under backed blocks"
        );
        for pg in want {
            assert!(
                b.is_range_mapped(pg * g, g),
                "page {pg} is under a backed block but unmapped"
            );
        }
        assert_eq!(p.stats().range_mapped, b.stats().mapped_bytes);
        held_matches(&backend, &p);
    };
    for phase in 0..4u64 {
        let barrier = Arc::new(Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (b, owned, barrier) = (b.clone(), owned.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let mut rng = Rng::new(phase * 100 + t as u64);
                    barrier.wait();
                    for _ in 0..150 {
                        let blk = rng.below(96) as usize;
                        // A block is driven by one thread at a time (as an engine would).
                        let Some(mut mine) = owned[blk].try_lock() else {
                            continue;
                        };
                        if *mine {
                            b.release([blk]).expect("release");
                            *mine = false;
                        } else {
                            b.ensure_backed([blk]).expect("ensure");
                            *mine = true;
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("thread");
        }
        check(&b);
    }
    let all: Vec<usize> = (0..96).filter(|&i| b.is_backed(i)).collect();
    b.release(all).expect("release all");
    assert_eq!(b.stats().mapped_pages, 0);
    check(&b);
}
