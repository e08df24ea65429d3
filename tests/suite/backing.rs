//! Regions and elastic block backing, generic over the backend (host in CI, CUDA on the GPU).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

use elastic_vmm::backend::testing::FaultInjector;
use elastic_vmm::backing::RegionInfo;
use elastic_vmm::{
    Backend, BlockBacking, BlockGeometry, DriverCall, Error, MappingHook, MemOptions, ModelConfig,
    Pool, PoolConfig, SharedPool, SharedPoolConfig, UniformBlocks,
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

/// Fill the pool's chunk cache with chunks of 2 granules and of 1, as a history of mixed
/// mappings leaves it.
fn mixed_cache(p: &Pool, g: u64) {
    let two = p
        .reserve_region_with(8 * g, &MemOptions::new().chunk(2 * g))
        .expect("scratch region");
    two.map(0, 8 * g).expect("2-granule chunks");
    let one = p.reserve_region(4 * g).expect("scratch region");
    one.map(0, 4 * g).expect("1-granule chunks");
    two.unmap(0, 8 * g).expect("to the cache");
    one.unmap(0, 4 * g).expect("to the cache");
    assert!(p.stats().cached >= 12 * g, "the cache holds them");
    assert_eq!(p.stats().cached_chunks, 8, "four of each size");
}

/// Every chunk under `b` lies inside one page.
fn chunks_inside_pages<G: BlockGeometry>(b: &BlockBacking<G>, what: &str) {
    let page = b.page_size();
    for c in b.chunks_in(0, b.len()) {
        assert_eq!(
            c.offset / page,
            (c.offset + c.size - 1) / page,
            "{what}: chunk [{:#x}, +{:#x}) crosses a page boundary (pages of {page:#x})",
            c.offset,
            c.size
        );
    }
}

/// Pages of three granules, backed in one run after a history that filled the chunk cache
/// with 2- and 1-granule chunks: no chunk crosses a page, so each page is released alone, in
/// full, and the hook hears of whole pages only.
pub fn backing_pages_hold_whole_chunks(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(&backend, 128 * g);
    mixed_cache(&p, g);
    let page = 3 * g;
    let hook = Arc::new(Recorder::default());
    let b = BlockBacking::reserve(
        &p,
        UniformBlocks::packed(6, page),
        &MemOptions::new().chunk(page),
        Some(hook.clone()),
    )
    .expect("backing");
    assert_eq!(b.ensure_backed(0..4).expect("4 pages").bytes, 4 * page);
    chunks_inside_pages(&b, "after backing pages 0-3 in one run");
    for pg in 0..4 {
        let covered: u64 = b.chunks_in(pg * page, page).iter().map(|c| c.size).sum();
        assert_eq!(covered, page, "page {pg} is whole chunks");
    }
    // Page 1 alone: unmapped in full, nothing left behind, neighbours untouched.
    let change = b.release([1]).expect("release page 1");
    assert_eq!(
        (change.bytes, change.left_mapped),
        (page, 0),
        "page 1 unmapped alone"
    );
    assert!(b.is_range_mapped(0, page) && !b.is_range_mapped(page, 1));
    assert!(b.is_range_mapped(2 * page, 2 * page));
    assert_eq!(
        hook.events.lock().last().copied(),
        Some(("unmapping", page, page)),
        "the hook heard of page 1 only"
    );
    // Backed again (now from its own freed chunks), and the rest: still whole pages.
    b.ensure_backed([1, 4, 5]).expect("more pages");
    chunks_inside_pages(&b, "after backing pages 1, 4 and 5");
    for blk in [0, 2, 4] {
        let change = b.release([blk]).expect("release");
        assert_eq!((change.bytes, change.left_mapped), (page, 0), "page {blk}");
    }
    assert_eq!(b.stats().mapped_pages, 3);
    held_matches(&backend, &p);
    drop(b);
    assert_eq!(hook.live_bytes(), 0, "every page let go of");
    p.trim().expect("trim");
    assert_eq!(backend.physical_bytes().expect("held"), 0);
}

/// A page size that is a multiple of the granularity and does not divide the blocks' extent:
/// `reserve` covers whole pages so the last block can be backed; `new` refuses a region that
/// stops short of the last page, with the numbers.
pub fn backing_covers_whole_pages(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(&backend, 64 * g);
    let page = 3 * g;
    let geo = UniformBlocks::packed(5, g); // 5 granules: 2 pages of 3
    let opts = MemOptions::new().chunk(page);
    match BlockBacking::new(
        p.reserve_region_with(5 * g, &opts).expect("region"),
        geo,
        None,
    ) {
        Err(Error::InvalidArgument(m)) => assert!(
            m.contains(&format!("{}", 5 * g))
                && m.contains(&format!("{}", 6 * g))
                && m.contains(&format!("pages of {page}")),
            "{m}"
        ),
        other => panic!("a region short of whole pages must be refused, got {other:?}"),
    }
    assert_eq!(
        p.stats().reserved_regions,
        0,
        "the refused region went back"
    );
    let b = BlockBacking::reserve(&p, geo, &MemOptions::new().chunk(page), None).expect("backing");
    assert_eq!(b.len(), 6 * g, "two whole pages");
    assert_eq!(b.physical_bytes_for(0..5).expect("cost"), 2 * page);
    assert_eq!(b.ensure_backed([4]).expect("last block").bytes, page);
    let data: Vec<u8> = (0..g).map(|i| (i % 253) as u8).collect();
    // SAFETY: block 4 is backed and nothing else uses the backing.
    unsafe { b.write(4 * g, &data) }.expect("write the last block");
    let mut back = vec![0u8; data.len()];
    // SAFETY: as above.
    unsafe { b.read(4 * g, &mut back) }.expect("read the last block");
    assert!(back == data, "the last block holds its data");
    b.ensure_backed(0..4).expect("the rest");
    assert_eq!(b.stats().mapped_bytes, 2 * page);
    b.release(0..5).expect("release all");
    assert_eq!(b.stats().mapped_pages, 0);
    held_matches(&backend, &p);
}

/// Blocks whose spans are given by the test: `spans[b]` for block `b`.
struct Spans {
    spans: Vec<Vec<(u64, u64)>>,
    extent: u64,
}

impl BlockGeometry for Spans {
    fn num_blocks(&self) -> usize {
        self.spans.len()
    }
    fn extent(&self) -> elastic_vmm::Result<u64> {
        Ok(self.extent)
    }
    fn block_spans(&self, block: usize, out: &mut Vec<(u64, u64)>) {
        out.extend_from_slice(&self.spans[block]);
    }
}

/// Bad geometries and page sizes are errors with the numbers in them, never a panic, a wrap or
/// a huge allocation, and change nothing: empty spans, spans past the extent or past 2^64,
/// uniform blocks whose extent overflows, empty or overlapping uniform blocks.
pub fn backing_refuses_bad_input(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(&backend, 64 * g);
    let geo = Spans {
        spans: vec![
            vec![(0, 0)],                  // empty, at the region's start
            vec![(g, g)],                  // fine
            vec![(2 * g, g), (4 * g, 0)],  // one good span, one empty
            vec![(7 * g, 2 * g)],          // past the extent of 8 granules
            vec![(u64::MAX - 5, 10)],      // past 2^64
            vec![(3 * g, g), (3 * g, 10)], // two spans on one page: fine
        ],
        extent: 8 * g,
    };
    let b =
        BlockBacking::new(p.reserve_region(8 * g).expect("region"), geo, None).expect("backing");
    let refused =
        |r: elastic_vmm::Result<elastic_vmm::BackingChange>, block: usize, why: &str| match r {
            Err(Error::InvalidArgument(m)) => {
                assert!(
                    m.contains(&format!("block {block}")) && m.contains(why),
                    "block {block}: {m}"
                )
            }
            other => panic!("block {block}: expected a refusal ({why}), got {other:?}"),
        };
    refused(b.ensure_backed([1, 0]), 0, "empty");
    refused(b.ensure_backed([2]), 2, "empty");
    refused(b.ensure_backed([3]), 3, "outside");
    refused(b.ensure_backed([4]), 4, "outside");
    assert!(matches!(
        b.physical_bytes_for([0]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        b.additional_bytes_for([4]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(b.pin([0], "t"), Err(Error::InvalidArgument(_))));
    let s = b.stats();
    assert_eq!((s.backed_blocks, s.mapped_pages), (0, 0), "nothing changed");
    assert_eq!(p.stats().range_mapped, 0);
    // The good blocks work, and a refused release of a bad one changes nothing either.
    assert_eq!(b.ensure_backed([1, 5]).expect("good blocks").bytes, 2 * g);
    refused(b.release([1, 0]), 0, "empty");
    assert!(b.is_backed(1), "the refused release kept block 1");
    b.release([1, 5]).expect("release");
    drop(b);

    // Uniform blocks: overflow, empty blocks, overlapping blocks, bad pages; the regions of the
    // refused backings go back.
    let huge = UniformBlocks {
        num_blocks: 1 << 40,
        block_bytes: g,
        stride: 1 << 40,
    };
    for (geo, what) in [
        (huge, "uniform blocks extent"),
        (UniformBlocks::packed(4, 0), "0 bytes"),
        (
            UniformBlocks {
                num_blocks: 4,
                block_bytes: 2 * g,
                stride: g,
            },
            "overlap",
        ),
    ] {
        let region = p.reserve_region(4 * g).expect("region");
        match BlockBacking::new(region, geo, None) {
            Err(e) => assert!(e.to_string().contains(what), "{what}: {e}"),
            Ok(_) => panic!("{geo:?} accepted"),
        }
    }
    match BlockBacking::new(p.reserve_region(4 * g).expect("region"), huge, None) {
        Err(e @ Error::SizeOverflow { .. }) => {
            let m = e.to_string();
            assert!(
                m.contains("1099511627776") && m.contains(&g.to_string()),
                "{m}"
            )
        }
        other => panic!("expected SizeOverflow, got {other:?}"),
    }
    for page in [0, g / 2, 3 * g / 2] {
        let r = BlockBacking::reserve(
            &p,
            UniformBlocks::packed(4, g),
            &MemOptions::new().chunk(page),
            None,
        );
        assert!(
            matches!(r, Err(Error::Misaligned { what: "chunk", value, .. }) if value == page),
            "page {page}: {r:?}"
        );
    }
    assert_eq!(
        p.stats().reserved_regions,
        0,
        "refused backings keep no region"
    );
    held_matches(&backend, &p);
}

/// Pins hold blocks against release (an error naming the block, its pins and a holder, and
/// nothing changes), only backed blocks can be pinned, pins count, and a backing dropped while
/// pinned keeps its memory (and its hook's registrations) until the last pin goes.
pub fn backing_pins_hold_blocks(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(&backend, 64 * g);
    let hook = Arc::new(Recorder::default());
    let b = BlockBacking::reserve(
        &p,
        UniformBlocks::packed(8, g),
        &MemOptions::new(),
        Some(hook.clone()),
    )
    .expect("backing");
    b.ensure_backed(0..4).expect("back");
    // Unsorted with a duplicate: sorted, each block pinned once.
    let twice = b.pin([3, 0, 3, 2], "twice").expect("pin");
    assert_eq!(twice.blocks(), &[0, 2, 3]);
    assert_eq!(b.stats().pinned_blocks, 3);
    drop(twice);
    let pin = b.pin([2, 1], "a test transfer").expect("pin");
    assert_eq!(pin.blocks(), &[1, 2]);
    assert_eq!(b.stats().pinned_blocks, 2);
    match b.release([0, 1]) {
        Err(e @ Error::BlockPinned { .. }) => {
            let m = e.to_string();
            let Error::BlockPinned {
                block,
                pins,
                holder,
                blocks,
            } = e
            else {
                unreachable!()
            };
            assert_eq!(
                (block, pins, holder.as_str(), blocks),
                (1, 1, "a test transfer", 2)
            );
            assert!(
                m.contains("block 1") && m.contains("a test transfer"),
                "{m}"
            );
        }
        other => panic!("expected BlockPinned, got {other:?}"),
    }
    assert!(
        b.is_backed(0) && b.is_backed(1),
        "the refused release changed nothing"
    );
    assert_eq!(b.release([0]).expect("unpinned block").bytes, g);
    match b.pin([3, 0], "late") {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("block 0 is not backed"), "{m}"),
        other => panic!("expected a refused pin, got {other:?}"),
    }
    assert!(matches!(b.pin([8], "x"), Err(Error::InvalidArgument(_))));
    assert_eq!(b.stats().pinned_blocks, 2, "refused pins pin nothing");
    // Pins count: block 2 goes only when both are dropped.
    let second = b.pin([2, 3], "second").expect("second pin");
    drop(pin);
    assert_eq!(b.release([1]).expect("pin dropped").bytes, g);
    match b.release([2]) {
        Err(Error::BlockPinned { pins, holder, .. }) => {
            assert_eq!((pins, holder.as_str()), (1, "second"))
        }
        other => panic!("expected BlockPinned, got {other:?}"),
    }
    // Dropped while pinned: memory and registrations stay until the pin goes.
    let held = p.stats().range_mapped;
    assert_eq!(held, 2 * g);
    drop(b);
    assert_eq!(
        p.stats().range_mapped,
        held,
        "pinned memory outlives its backing's handle"
    );
    assert_eq!(
        hook.live_bytes(),
        held as i64,
        "and so do its registrations"
    );
    assert_eq!(p.stats().reserved_regions, 8 * g);
    drop(second);
    let s = p.stats();
    assert_eq!(
        (s.range_mapped, s.reserved_regions),
        (0, 0),
        "all given back with the pin"
    );
    assert_eq!(hook.live_bytes(), 0);
    held_matches(&backend, &p);
}

/// Users pin blocks, write them, wait and read them back while other threads release and back
/// blocks (some of them the pinned ones) as fast as they can: a pinned block is never
/// released, so its data survives and its pages stay mapped; refused releases change nothing.
pub fn backing_pins_concurrent(backend: Arc<dyn Backend>) {
    const USERS: usize = 4;
    const RELEASERS: usize = 3;
    const BLOCKS: usize = 24;
    let g = backend.info().granularity as u64;
    // No chunk cache: memory released under a user would come back as other memory (zeros).
    let p = Pool::new(
        backend.clone(),
        PoolConfig::new(256 * g as usize)
            .growth_divisor(0)
            .max_cached(0),
    )
    .expect("pool");
    // A page per block: releasing one unmaps its page.
    let bytes = g;
    let b = Arc::new(
        BlockBacking::reserve(
            &p,
            UniformBlocks::packed(BLOCKS, bytes),
            &MemOptions::new(),
            None,
        )
        .expect("backing"),
    );
    b.ensure_backed(0..BLOCKS).expect("back");
    // One user at a time per block (users write the bytes; releasers never touch them).
    let used: Arc<Vec<Mutex<()>>> = Arc::new((0..BLOCKS).map(|_| Mutex::new(())).collect());
    let uses = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let barrier = Arc::new(Barrier::new(USERS + RELEASERS));
    let mut handles = Vec::new();
    for t in 0..USERS {
        let (b, used, uses, barrier) = (b.clone(), used.clone(), uses.clone(), barrier.clone());
        handles.push(std::thread::spawn(move || {
            let mut rng = Rng::new(1000 + t as u64);
            barrier.wait();
            for round in 0..60u64 {
                let blk = rng.below(BLOCKS as u64) as usize;
                let Some(_mine) = used[blk].try_lock() else {
                    continue;
                };
                let Ok(pin) = b.pin([blk], "a user") else {
                    continue; // released right now: not backed
                };
                let at = blk as u64 * bytes;
                let data: Vec<u8> = (0..bytes).map(|i| (i ^ round ^ t as u64) as u8).collect();
                // SAFETY: the block is pinned (backed until `pin` drops) and this thread is its
                // only user (`used[blk]`); releasers do not touch its bytes.
                unsafe { b.write(at, &data) }.expect("write a pinned block");
                std::thread::sleep(std::time::Duration::from_micros(rng.below(300)));
                assert!(b.is_range_mapped(at, bytes), "pinned block {blk} unmapped");
                let mut back = vec![0u8; bytes as usize];
                // SAFETY: as above.
                unsafe { b.read(at, &mut back) }.expect("read a pinned block");
                assert!(back == data, "pinned block {blk} lost its data");
                drop(pin);
                uses.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in 0..RELEASERS {
        let (b, refused, barrier) = (b.clone(), refused.clone(), barrier.clone());
        handles.push(std::thread::spawn(move || {
            let mut rng = Rng::new(2000 + t as u64);
            barrier.wait();
            for _ in 0..300 {
                let blk = rng.below(BLOCKS as u64) as usize;
                match b.release([blk]) {
                    Ok(_) => {
                        b.ensure_backed([blk]).expect("back again");
                    }
                    Err(Error::BlockPinned { block, .. }) => {
                        assert_eq!(block, blk);
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                    // Another releaser has it right now.
                    Err(Error::InvalidArgument(m)) => assert!(m.contains("not backed"), "{m}"),
                    Err(e) => panic!("release: {e}"),
                }
                if rng.below(4) == 0 {
                    std::thread::yield_now();
                }
            }
        }));
    }
    for h in handles {
        h.join().expect("thread");
    }
    let s = b.stats();
    assert_eq!(s.pinned_blocks, 0, "every pin went");
    assert!(uses.load(Ordering::Relaxed) > 0, "users got their blocks");
    println!(
        "{} uses of pinned blocks, {} releases refused by a pin",
        uses.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed)
    );
    let backed: Vec<usize> = (0..BLOCKS).filter(|&i| b.is_backed(i)).collect();
    assert_eq!(s.backed_blocks, backed.len());
    b.release(backed).expect("release all");
    assert_eq!(b.stats().mapped_pages, 0);
    assert_eq!(p.stats().range_mapped, 0);
    held_matches(&backend, &p);
}
