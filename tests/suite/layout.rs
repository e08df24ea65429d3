//! KV-cache layouts on real memory, generic over the backend (host in CI, CUDA on the GPU), and
//! with the `nixl` feature their NIXL registration and transfers.

use std::sync::Arc;

use elastic_vmm::backend::testing::FaultInjector;
use elastic_vmm::layout::{
    BlockDim, ElasticLayout, Layout, LayoutBuilder, LayoutConfig, LayoutKind, LayoutViews,
    MemoryRange, MemoryView, REGION_ALIGNMENT,
};
use elastic_vmm::{Backend, DriverCall, Error, MemOptions, Pool, PoolConfig};

use super::Rng;

pub const KINDS: [LayoutKind; 3] = [
    LayoutKind::FullyContiguous,
    LayoutKind::LayerSeparate(BlockDim::First),
    LayoutKind::LayerSeparate(BlockDim::Second),
];

pub fn pool(backend: &Arc<dyn Backend>, capacity: u64) -> Pool {
    Pool::new(
        backend.clone(),
        PoolConfig::new(capacity as usize).growth_divisor(0),
    )
    .expect("pool")
}

/// The backend holds exactly what the pool says it holds.
pub fn held_matches(backend: &Arc<dyn Backend>, p: &Pool) {
    let s = p.stats();
    assert_eq!(
        backend.physical_bytes().expect("physical"),
        s.mapped + s.cached,
        "backend holds what the pool says"
    );
    p.audit().expect("audit");
}

/// Byte access to a layout's memory, whatever holds it.
pub trait Bytes {
    fn views(&self) -> &LayoutViews;
    fn put(&self, addr: u64, data: &[u8]) -> elastic_vmm::Result<()>;
    fn get(&self, addr: u64, out: &mut [u8]) -> elastic_vmm::Result<()>;
}

impl Bytes for Layout {
    fn views(&self) -> &LayoutViews {
        Layout::views(self)
    }
    fn put(&self, addr: u64, data: &[u8]) -> elastic_vmm::Result<()> {
        // SAFETY: tests use each layout from one thread, with no transfer in flight.
        unsafe { self.write(addr, data) }
    }
    fn get(&self, addr: u64, out: &mut [u8]) -> elastic_vmm::Result<()> {
        // SAFETY: as above.
        unsafe { self.read(addr, out) }
    }
}

impl Bytes for ElasticLayout {
    fn views(&self) -> &LayoutViews {
        ElasticLayout::views(self)
    }
    fn put(&self, addr: u64, data: &[u8]) -> elastic_vmm::Result<()> {
        // SAFETY: as above; blocks are not released meanwhile.
        unsafe { self.write(addr, data) }
    }
    fn get(&self, addr: u64, out: &mut [u8]) -> elastic_vmm::Result<()> {
        // SAFETY: as above.
        unsafe { self.read(addr, out) }
    }
}

/// The bytes of unit `(block, layer, outer)` under `seed`.
pub fn unit_pattern(seed: u64, block: usize, layer: usize, outer: usize, len: u64) -> Vec<u8> {
    let mut r = Rng::new(seed ^ ((block as u64) << 32) ^ ((layer as u64) << 16) ^ outer as u64);
    let mut out = Vec::with_capacity(len as usize);
    while out.len() < len as usize {
        out.extend_from_slice(&r.next().to_le_bytes());
    }
    out.truncate(len as usize);
    out
}

/// Write every unit of `blocks`, each with its own pattern.
pub fn fill(l: &dyn Bytes, blocks: &[usize], seed: u64) {
    let c = *l.views().config();
    for &b in blocks {
        for layer in 0..c.num_layers {
            for o in 0..c.outer_dim {
                let v = l.views().unit(b, layer, o).expect("unit");
                l.put(v.addr, &unit_pattern(seed, b, layer, o, v.len))
                    .expect("write unit");
            }
        }
    }
}

/// Every unit of `blocks[i]` holds the pattern of unit `from[i]` under `seed`.
pub fn check(l: &dyn Bytes, blocks: &[usize], from: &[usize], seed: u64, what: &str) {
    let c = *l.views().config();
    for (&b, &f) in blocks.iter().zip(from) {
        for layer in 0..c.num_layers {
            for o in 0..c.outer_dim {
                let v = l.views().unit(b, layer, o).expect("unit");
                let mut back = vec![0u8; v.len as usize];
                l.get(v.addr, &mut back).expect("read unit");
                assert!(
                    back == unit_pattern(seed, f, layer, o, v.len),
                    "{what}: block {b} layer {layer} outer {o} at {:#x} does not hold block {f}'s bytes",
                    v.addr
                );
            }
        }
    }
}

/// Where unit (b, l, o) should be, computed here independently: (region, offset).
pub fn expected_place(
    kind: LayoutKind,
    c: &LayoutConfig,
    b: usize,
    l: usize,
    o: usize,
) -> (usize, u64) {
    let unit = (c.page_size * c.inner_dim * c.dtype_width_bytes) as u64;
    let idx = match kind {
        LayoutKind::FullyContiguous => (b * c.num_layers + l) * c.outer_dim + o,
        LayoutKind::LayerSeparate(BlockDim::First) => b * c.outer_dim + o,
        LayoutKind::LayerSeparate(BlockDim::Second) => o * c.num_blocks + b,
    };
    let region = if kind == LayoutKind::FullyContiguous {
        0
    } else {
        l
    };
    (region, idx as u64 * unit)
}

/// Data written unit by unit lands where the kind says, in 512-byte aligned regions carved
/// out of pool memory, without overlap; whole-block and merged views read it back in the
/// kind's order; dropping the layout gives the memory back.
pub fn layout_views_place_data(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(&backend, 256 * g);
    // Unit 160 bytes; a layer region of 1920 bytes, padded to 2048 between regions.
    let c = LayoutConfig::new(6, 3, 2, 4, 20, 2);
    for kind in KINDS {
        for memory in ["allocation", "region"] {
            let b = LayoutBuilder::new().config(c).kind(kind);
            let l = match memory {
                "allocation" => b.allocate(&p, &MemOptions::new()).build(),
                _ => b.map_region(&p, &MemOptions::new().chunk(g)).build(),
            }
            .expect("layout");
            let what = format!("{kind} in a pool {memory}");
            let regions = l.regions();
            assert_eq!(regions.len(), kind.num_regions(c.num_layers), "{what}");
            for (r, v) in regions.iter().enumerate() {
                assert_eq!(
                    v.addr % REGION_ALIGNMENT,
                    0,
                    "{what}: region {r} at {:#x}",
                    v.addr
                );
                assert_eq!(
                    v.addr,
                    regions[0].addr + r as u64 * 2048,
                    "{what}: region {r}"
                );
            }
            let all: Vec<usize> = (0..c.num_blocks).collect();
            fill(&l, &all, 7);
            for blk in 0..c.num_blocks {
                for layer in 0..c.num_layers {
                    for o in 0..c.outer_dim {
                        let (r, off) = expected_place(kind, &c, blk, layer, o);
                        let v = l.unit(blk, layer, o).expect("unit");
                        assert_eq!(
                            v.addr,
                            regions[r].addr + off,
                            "{what}: unit ({blk},{layer},{o})"
                        );
                    }
                }
            }
            // Written last to first would have clobbered any overlap: every unit still holds its own.
            check(&l, &all, &all, 7, &what);
            // A merged run of blocks 1..=3 holds exactly their units, in the kind's order.
            let run = l.blocks(1, 3).expect("run");
            let expect_views = match kind {
                LayoutKind::FullyContiguous => 1,
                LayoutKind::LayerSeparate(BlockDim::First) => c.num_layers,
                LayoutKind::LayerSeparate(BlockDim::Second) => c.num_layers * c.outer_dim,
            };
            assert_eq!(run.len(), expect_views, "{what}: views of a run");
            assert_eq!(
                l.block(2).expect("block").len(),
                expect_views,
                "{what}: views of a block"
            );
            let mut got = Vec::new();
            for v in &run {
                let mut buf = vec![0u8; v.len as usize];
                l.get(v.addr, &mut buf).expect("read run");
                got.extend(buf);
            }
            let mut want = Vec::new();
            let unit = c.page_size * c.inner_dim * c.dtype_width_bytes;
            match kind {
                LayoutKind::FullyContiguous => {
                    for blk in 1..4 {
                        for layer in 0..c.num_layers {
                            for o in 0..c.outer_dim {
                                want.extend(unit_pattern(7, blk, layer, o, unit as u64));
                            }
                        }
                    }
                }
                LayoutKind::LayerSeparate(BlockDim::First) => {
                    for layer in 0..c.num_layers {
                        for blk in 1..4 {
                            for o in 0..c.outer_dim {
                                want.extend(unit_pattern(7, blk, layer, o, unit as u64));
                            }
                        }
                    }
                }
                LayoutKind::LayerSeparate(BlockDim::Second) => {
                    for layer in 0..c.num_layers {
                        for o in 0..c.outer_dim {
                            for blk in 1..4 {
                                want.extend(unit_pattern(7, blk, layer, o, unit as u64));
                            }
                        }
                    }
                }
            }
            assert!(
                got == want,
                "{what}: a merged run does not read back its blocks in order"
            );
            // Runs split where the indices stop being consecutive.
            assert_eq!(
                l.runs(&[1, 2, 3, 5]).expect("runs").len(),
                2 * expect_views,
                "{what}"
            );
            assert_eq!(
                l.runs(&[3, 2]).expect("runs").len(),
                2 * expect_views,
                "{what}"
            );
            // Chunks cover the layout exactly, each inside one physical chunk.
            let chunks = l.chunks();
            let covered: u64 = chunks.iter().map(|v| v.len).sum();
            assert_eq!(
                covered,
                l.geometry().extent(),
                "{what}: chunks cover the layout"
            );
            if memory == "region" {
                for v in &chunks {
                    assert_eq!(
                        v.addr / g,
                        (v.end().expect("end") - 1) / g,
                        "{what}: chunk of one granule"
                    );
                }
            }
            // Bytes outside the layout are refused, not touched.
            let end = regions.last().expect("a region").end().expect("end");
            assert!(
                matches!(l.put(end, &[1]), Err(Error::InvalidLayout(_))),
                "{what}"
            );
            drop(l);
            let s = p.stats();
            assert_eq!(
                (s.in_use, s.reserved_regions, s.range_mapped),
                (0, 0, 0),
                "{what}: memory given back"
            );
            held_matches(&backend, &p);
        }
    }
    p.trim().expect("trim");
    assert_eq!(backend.physical_bytes().expect("held"), 0);
}

/// Caller-supplied regions: placed as given, validated (count, alignment, size, one memory
/// kind), not owned (the caller's memory outlives the layout untouched).
pub fn layout_over_caller_regions(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(&backend, 64 * g);
    let c = LayoutConfig::new(4, 2, 2, 16, 64, 2); // layer region: 4 * 2 * 2048 = 16 KiB
    let mut owner = p.allocate(4 * g as usize).expect("caller memory");
    owner.fill(0x5A).expect("fill");
    let info = backend.info();
    let range = |addr: u64, len: u64| MemoryRange {
        addr,
        len,
        kind: info.memory_kind,
        device: info.device_ordinal,
    };
    let base = owner.addr();
    let ranges = vec![range(base + g, 16 << 10), range(base, 16 << 10)];
    // SAFETY: both ranges lie in `owner`, live host or device memory of the backend's kind,
    // which outlives the layout (dropped below, before `owner`).
    let caller = unsafe {
        LayoutBuilder::new()
            .config(c)
            .layer_separate(BlockDim::Second)
            .regions(ranges.clone())
    };
    let l = caller.build().expect("caller layout");
    assert_eq!(
        l.unit(0, 0, 0).expect("unit").addr,
        base + g,
        "layer 0 where given"
    );
    assert_eq!(
        l.unit(3, 1, 1).expect("unit").addr,
        base + (4 + 3) * 2048,
        "layer 1 where given"
    );
    assert_eq!(
        l.chunks(),
        vec![
            MemoryView {
                addr: base + g,
                len: 16 << 10
            },
            MemoryView {
                addr: base,
                len: 16 << 10
            }
        ]
    );
    assert!(l.pool().is_none());
    assert!(
        matches!(l.put(base, &[0]), Err(Error::InvalidArgument(_))),
        "no copy path for caller memory"
    );
    drop(l);
    let mut back = vec![0u8; 4 * g as usize];
    owner.read(0, &mut back).expect("read");
    assert!(
        back.iter().all(|&x| x == 0x5A),
        "the caller's memory is untouched"
    );
    let build = |rs: Vec<MemoryRange>| {
        // SAFETY: every range given lies in `owner` (alive until the end), or is refused by
        // `build` before anything is made of it; the layouts are dropped at once.
        unsafe {
            LayoutBuilder::new()
                .config(c)
                .layer_separate(BlockDim::First)
                .regions(rs)
        }
        .build()
    };
    let msg = |r: elastic_vmm::Result<Layout>| match r {
        Err(Error::InvalidLayout(m)) => m,
        other => panic!("expected InvalidLayout, got {other:?}"),
    };
    let m = msg(build(vec![range(base, 16 << 10)]));
    assert!(
        m.contains("1 regions supplied") && m.contains("needs 2"),
        "{m}"
    );
    let m = msg(build(vec![
        range(base, 16 << 10),
        range(base + g + 256, 16 << 10),
    ]));
    assert!(m.contains("region 1") && m.contains("512"), "{m}");
    let m = msg(build(vec![range(base, 16 << 10), range(base + g, 1000)]));
    assert!(m.contains("1000 bytes") && m.contains("16384"), "{m}");
    let other = match info.memory_kind {
        elastic_vmm::MemoryKind::Host => MemoryRange {
            kind: elastic_vmm::MemoryKind::Device,
            device: Some(0),
            ..range(base + g, 16 << 10)
        },
        elastic_vmm::MemoryKind::Device => MemoryRange {
            kind: elastic_vmm::MemoryKind::Host,
            device: None,
            ..range(base + g, 16 << 10)
        },
    };
    let m = msg(build(vec![range(base, 16 << 10), other]));
    assert!(m.contains("share one storage kind"), "{m}");
    drop(owner);
    held_matches(&backend, &p);
}

/// An elastic layout maps pages only under backed blocks; pages shared by several blocks stay
/// mapped while any of them is backed; the cost of a set of blocks counts each page once;
/// unbacked memory is refused, not touched; dropping gives everything back.
pub fn elastic_layout_backs_on_demand(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(&backend, 256 * g);
    // A unit of g/8: a block is g/4 per layer (block first), four blocks share a page per layer.
    let page = (g / 8) as usize;
    let c = LayoutConfig::new(16, 2, 2, page / 256, 128, 2);
    assert_eq!(c.sizes().expect("sizes").unit, g / 8);
    let l = LayoutBuilder::new()
        .config(c)
        .layer_separate(BlockDim::First)
        .elastic(&p, &MemOptions::new())
        .build()
        .expect("elastic");
    assert_eq!(l.stats().mapped_pages, 0, "nothing mapped at build");
    assert_eq!(l.len(), 8 * g, "two layer regions of 4 pages");
    assert_eq!(
        l.physical_bytes_for([0]).expect("cost"),
        2 * g,
        "one page per layer"
    );
    assert_eq!(
        l.physical_bytes_for([0, 1, 2, 3]).expect("cost"),
        2 * g,
        "shared pages count once"
    );
    assert_eq!(l.physical_bytes_for([0, 4, 15]).expect("cost"), 6 * g);
    assert!(matches!(
        l.physical_bytes_for([16]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(l.ensure_backed([1]).expect("back").bytes, 2 * g);
    assert_eq!(
        l.additional_bytes_for([0, 2, 4]).expect("extra"),
        2 * g,
        "only block 4's pages"
    );
    assert_eq!(l.ensure_backed([2]).expect("back").bytes, 0, "same pages");
    fill(&l, &[1, 2], 3);
    check(&l, &[1, 2], &[1, 2], 3, "backed blocks");
    let v = l.unit(4, 1, 0).expect("unit");
    assert!(
        matches!(l.put(v.addr, &[1; 8]), Err(Error::RangeNotMapped { .. })),
        "unbacked block 4 refused"
    );
    assert_eq!(
        l.release([1]).expect("release").bytes,
        0,
        "block 2 still holds the pages"
    );
    check(&l, &[2], &[2], 3, "block 2 after block 1 went");
    assert!(!l.is_backed(1) && l.is_backed(2));
    assert!(
        matches!(l.release([1]), Err(Error::InvalidArgument(_))),
        "double release refused"
    );
    assert_eq!(
        l.release([2]).expect("release").bytes,
        2 * g,
        "last block on them: unmapped"
    );
    assert_eq!(l.stats().mapped_pages, 0);
    // Block second: a block is a unit per layer and outer index, g/8 each, on 4 pages.
    let ls = LayoutBuilder::new()
        .config(c)
        .layer_separate(BlockDim::Second)
        .elastic(&p, &MemOptions::new())
        .build()
        .expect("block second");
    assert_eq!(ls.physical_bytes_for([5]).expect("cost"), 4 * g);
    assert_eq!(
        ls.physical_bytes_for([0, 7]).expect("cost"),
        4 * g,
        "blocks 0..8 of an outer index share a page"
    );
    assert_eq!(ls.physical_bytes_for([0, 8]).expect("cost"), 8 * g);
    // Fully contiguous: a block is g/2, pages hold two blocks.
    let fc = LayoutBuilder::new()
        .config(c)
        .fully_contiguous()
        .elastic(&p, &MemOptions::new().chunk(2 * g))
        .build()
        .expect("fully contiguous");
    assert_eq!(fc.backing().page_size(), 2 * g);
    assert_eq!(
        fc.physical_bytes_for([0, 1, 2, 3]).expect("cost"),
        2 * g,
        "pages of 2 granules hold 4 blocks"
    );
    fc.ensure_backed([0, 5]).expect("back");
    assert_eq!(fc.stats().mapped_bytes, 4 * g);
    fill(&fc, &[0, 5], 11);
    check(&fc, &[0, 5], &[0, 5], 11, "fully contiguous elastic");
    held_matches(&backend, &p);
    drop((l, ls, fc));
    let s = p.stats();
    assert_eq!(
        (s.reserved_regions, s.range_mapped),
        (0, 0),
        "regions and mappings given back"
    );
    p.trim().expect("trim");
    assert_eq!(backend.physical_bytes().expect("held"), 0);
}

/// A driver failure while backing blocks rolls back: nothing stays mapped, the blocks are not
/// backed, and the layout works once the driver does.
pub fn elastic_layout_rolls_back(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let fault = Arc::new(FaultInjector::new(backend.clone()));
    let dyn_fault: Arc<dyn Backend> = fault.clone();
    let p = pool(&dyn_fault, 64 * g);
    let c = LayoutConfig::new(8, 2, 1, (g / 1024) as usize, 256, 4); // a block is g per layer
    let l = LayoutBuilder::new()
        .config(c)
        .layer_separate(BlockDim::First)
        .elastic(&p, &MemOptions::new())
        .build()
        .expect("elastic");
    l.ensure_backed([0]).expect("back");
    let before = l.stats();
    // Blocks 3 and 6 need 4 pages in 4 runs; the third map fails.
    fault.fail_nth(DriverCall::Map, 3);
    let err = l.ensure_backed([3, 6]).expect_err("injected failure");
    assert!(matches!(err, Error::Backend { .. }), "{err}");
    assert_eq!(l.stats(), before, "nothing changed");
    assert!(!l.is_backed(3) && !l.is_backed(6));
    assert_eq!(
        l.region_mapped_bytes(),
        2 * g,
        "only block 0's pages mapped"
    );
    held_matches(&dyn_fault, &p);
    fault.clear();
    l.ensure_backed([3, 6]).expect("works again");
    fill(&l, &[0, 3, 6], 5);
    check(&l, &[0, 3, 6], &[0, 3, 6], 5, "after rollback");
    drop(l);
    p.trim().expect("trim");
    assert_eq!(backend.physical_bytes().expect("held"), 0);
}

/// Pages of three granules that do not divide the layout: every kind reserves whole pages, so
/// its last blocks can be backed; data round-trips in every block; a pinned block is not
/// released; each page goes back whole.
pub fn elastic_layout_covers_whole_pages(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity as u64;
    let p = pool(&backend, 256 * g);
    // A unit of g/2, a block of 2g (2 layers x K/V): 10 granules of data, 4 pages of 3.
    let c = LayoutConfig::new(5, 2, 2, 16, (g / 64) as usize, 2);
    assert_eq!(c.sizes().expect("sizes").unit, g / 2);
    let page = 3 * g;
    let all: Vec<usize> = (0..5).collect();
    for kind in KINDS {
        let l = LayoutBuilder::new()
            .config(c)
            .kind(kind)
            .elastic(&p, &MemOptions::new().chunk(page))
            .build()
            .unwrap_or_else(|e| panic!("{kind}: {e}"));
        assert_eq!(l.len(), 4 * page, "{kind}: whole pages reserved");
        l.ensure_backed([4])
            .unwrap_or_else(|e| panic!("{kind}: the last block: {e}"));
        l.ensure_backed(0..5).expect("every block");
        fill(&l, &all, 21);
        check(&l, &all, &all, 21, &format!("{kind}, pages of 3 granules"));
        for c in l.chunks_in(0, l.len()) {
            assert_eq!(
                c.offset / page,
                (c.offset + c.size - 1) / page,
                "{kind}: {c:?}"
            );
        }
        let pin = l.pin([4], "a reader").expect("pin");
        assert!(
            matches!(l.release(0..5), Err(Error::BlockPinned { block: 4, .. })),
            "{kind}: a pinned block is not released"
        );
        assert_eq!(l.stats().backed_blocks, 5, "{kind}: nothing changed");
        drop(pin);
        let change = l.release(0..5).expect("release");
        assert_eq!(
            (change.bytes, change.left_mapped),
            (4 * page, 0),
            "{kind}: every page unmapped whole"
        );
        assert_eq!(l.region_mapped_bytes(), 0);
    }
    held_matches(&backend, &p);
}

#[cfg(feature = "nixl")]
pub mod nixl {
    //! NIXL registration and transfers over layouts, generic over the backend.

    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Barrier};
    use std::time::{Duration, Instant};

    use elastic_vmm::backend::testing::FaultInjector;
    use elastic_vmm::layout::{BlockDim, KvLayout, LayoutBuilder, LayoutConfig, MemoryRange};
    use elastic_vmm::nixl::{
        sys, transfer_blocks_via, BlockSet, NixlAgent, TransferOp, TransferPath, TransferReport,
        TransferVia,
    };
    use elastic_vmm::{Backend, DriverCall, Error, MemOptions, MemoryKind};

    use super::{check, fill, held_matches, pool, Bytes, Rng};

    static AGENTS: AtomicU64 = AtomicU64::new(0);

    /// A transfer through NIXL whatever the memory (these tests are of NIXL's mechanics:
    /// metadata, registrations, pins, timeouts); one that finishes says it took NIXL.
    fn transfer_blocks(
        op: TransferOp,
        local: BlockSet<'_>,
        remote: BlockSet<'_>,
        timeout: Duration,
    ) -> elastic_vmm::Result<TransferReport> {
        let r = transfer_blocks_via(op, local, remote, timeout, TransferVia::Nixl)?;
        assert_eq!(r.path, TransferPath::Nixl, "TransferVia::Nixl took NIXL");
        Ok(r)
    }

    /// A fully contiguous layout of `p`'s memory in chunks of `g`, registered with `a`, and an
    /// elastic block-second layout of `p` registering with `b`: units of 768 KiB, blocks of
    /// 3 MiB, so blocks straddle chunks, differently on each side.
    fn straddling_pair(
        p: &elastic_vmm::Pool,
        g: u64,
        a: &NixlAgent,
        b: &NixlAgent,
    ) -> (
        elastic_vmm::nixl::RegisteredLayout,
        elastic_vmm::layout::ElasticLayout,
    ) {
        let c = LayoutConfig::new(16, 2, 2, 16, 24576, 2);
        let src = a
            .register(
                LayoutBuilder::new()
                    .config(c)
                    .fully_contiguous()
                    .map_region(p, &MemOptions::new().chunk(g))
                    .build()
                    .expect("src"),
            )
            .expect("register src");
        let dst = LayoutBuilder::new()
            .config(c)
            .layer_separate(BlockDim::Second)
            .elastic(p, &MemOptions::new())
            .hook(b.mapping_hook())
            .build()
            .expect("dst");
        (src, dst)
    }

    /// By default ([`TransferVia::Auto`]) a transfer of host memory goes through NIXL and one
    /// of device memory in pools of one device is the crate's own device copy (UCX has no
    /// device path between two agents of one process); either way byte for byte, both
    /// directions, blocks straddling chunks differently on each side.
    pub fn transfers_take_the_path_their_memory_allows(backend: Arc<dyn Backend>) {
        let g = backend.info().granularity as u64;
        let p = pool(&backend, 256 * g);
        let (a, b) = (agent("path-a"), agent("path-b"));
        let (src, dst) = straddling_pair(&p, g, &a, &b);
        let want = match backend.info().memory_kind {
            MemoryKind::Host => TransferPath::Nixl,
            MemoryKind::Device => TransferPath::DeviceCopy,
        };
        let from = [0, 1, 2, 3, 9, 10, 15];
        let to = [12, 13, 14, 15, 6, 7, 0];
        fill(&*src, &from, 77);
        dst.ensure_backed(to).expect("back dst");
        let go = |op, sb: &[usize], db: &[usize]| {
            transfer_blocks_via(
                op,
                BlockSet {
                    agent: &a,
                    layout: &src,
                    blocks: sb,
                },
                BlockSet {
                    agent: &b,
                    layout: &dst,
                    blocks: db,
                },
                Duration::from_secs(60),
                TransferVia::Auto,
            )
            .expect("transfer")
        };
        let w = go(TransferOp::Write, &from, &to);
        assert_eq!(w.path, want, "{:?} memory", backend.info().memory_kind);
        let block = KvLayout::views(&src).geometry().sizes().block;
        assert_eq!(w.bytes, block * from.len() as u64);
        check(&dst, &to, &from, 77, "after WRITE");
        let back = [4, 5, 6, 7, 8, 11, 12];
        let r = go(TransferOp::Read, &back, &to);
        assert_eq!(r.path, want);
        check(&*src, &back, &from, 77, "after READ");
        println!(
            "{:?} memory: {:?}, WRITE {} B in {} copies, {:?}; READ {:?}",
            backend.info().memory_kind,
            w.path,
            w.bytes,
            w.descriptors,
            w.elapsed,
            r.elapsed
        );
        drop((src, dst));
        held_matches(&backend, &p);
    }

    /// A fresh agent with a name unique in the process.
    pub fn agent(what: &str) -> NixlAgent {
        let n = AGENTS.fetch_add(1, Ordering::Relaxed);
        NixlAgent::new(&format!("{what}-{}-{n}", std::process::id())).expect("NIXL agent with UCX")
    }

    /// NIXL's memory type and device for the backend's memory.
    fn expected_mem(backend: &Arc<dyn Backend>) -> (sys::MemType, u64) {
        let i = backend.info();
        match i.memory_kind {
            MemoryKind::Host => (sys::MemType::Dram, 0),
            MemoryKind::Device => (
                sys::MemType::Vram,
                i.device_ordinal.expect("ordinal") as u64,
            ),
        }
    }

    /// One registration per physical chunk; descriptors derived from the registration holding
    /// them, one per chunk a view touches; unregistered bytes and double registration refused.
    pub fn registration_follows_chunks(backend: Arc<dyn Backend>) {
        let g = backend.info().granularity as u64;
        let p = pool(&backend, 64 * g);
        let a = agent("chunks");
        // A block is g/2 (fully contiguous): 5 blocks span 2.5 granules, 3 chunks of g.
        let c = LayoutConfig::new(5, 2, 2, (g / 8192) as usize, 512, 2);
        assert_eq!(c.sizes().expect("sizes").block, g / 2);
        let l = LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .map_region(&p, &MemOptions::new().chunk(g))
            .build()
            .expect("layout");
        let r = a.register(l).expect("register");
        assert_eq!(r.chunks().len(), 3, "one registration per chunk");
        assert_eq!(a.registrations(), 3);
        assert_eq!(
            a.registered_bytes(),
            5 * g / 2,
            "the layout's bytes, clipped to it"
        );
        let base = r.regions()[0].addr;
        let (mem, dev) = expected_mem(&backend);
        // Block 1 is [g/2, g): inside chunk 0. Blocks 1..=2 are [g/2, 3g/2): across chunks 0 and 1.
        let one = a
            .descriptors(r.blocks(1, 1).expect("view")[0])
            .expect("descriptors");
        assert_eq!(one.len(), 1);
        let two = a
            .descriptors(r.blocks(1, 2).expect("view")[0])
            .expect("descriptors");
        assert_eq!(
            two.len(),
            2,
            "a view across two chunks gives two descriptors"
        );
        assert_eq!((two[0].addr, two[0].len), (base + g / 2, g / 2));
        assert_eq!((two[1].addr, two[1].len), (base + g, g / 2));
        assert!(
            two.iter().all(|d| d.mem_type == mem && d.device_id == dev),
            "{two:?}"
        );
        // Outside every registration: refused with the hole.
        match a.descriptors(elastic_vmm::layout::MemoryView {
            addr: base + 2 * g,
            len: g,
        }) {
            Err(Error::NotRegistered {
                hole_addr,
                hole_len,
                ..
            }) => {
                assert_eq!((hole_addr, hole_len), (base + 5 * g / 2, g / 2))
            }
            other => panic!("expected NotRegistered, got {other:?}"),
        }
        // The same memory again with the same agent: refused, nothing added.
        let info = backend.info();
        // SAFETY: the range is the layout `r` registered above, alive until after `again` (its
        // registration is refused below and the layout dropped with it).
        let again = unsafe {
            LayoutBuilder::new()
                .config(c)
                .fully_contiguous()
                .regions(vec![MemoryRange {
                    addr: base,
                    len: 5 * g / 2,
                    kind: info.memory_kind,
                    device: info.device_ordinal,
                }])
        }
        .build()
        .expect("caller layout");
        let err = a.register(again).expect_err("overlap");
        assert!(
            matches!(err, Error::InvalidArgument(ref m) if m.contains("registered already")),
            "{err}"
        );
        assert_eq!(a.registrations(), 3);
        // A second agent may register the same memory (each agent has its own registrations).
        let b = agent("chunks-b");
        let alloc_layout = LayoutBuilder::new()
            .config(c)
            .layer_separate(BlockDim::First)
            .allocate(&p, &MemOptions::new())
            .build()
            .expect("layout");
        let rb = b.register(alloc_layout).expect("register allocation");
        assert_eq!(b.registrations(), rb.chunks().len());
        assert_eq!(b.registered_bytes(), rb.geometry().extent());
        drop(r);
        assert_eq!(a.registrations(), 0, "dropped with the layout");
        drop(rb);
        assert_eq!((a.registrations(), b.registrations()), (0, 0));
        held_matches(&backend, &p);
    }

    /// Registrations follow the mapping of an elastic layout on every path: backing, release
    /// (shared pages stay registered), rollback of a failed backing, drop, and drop after the
    /// pool handle went.
    /// Sleep and NIXL: a fully mapped registered layout refuses its pool's sleep (NIXL would
    /// point at released memory); an elastic layout's registrations go before the sleep unmaps
    /// and come back, one per chunk, after the wake maps again.
    pub fn sleep_renews_registrations(backend: Arc<dyn Backend>) {
        use elastic_vmm::{AfterWake, SleepPolicy};
        let g = backend.info().granularity as u64;
        let p = pool(&backend, 64 * g);
        let a = agent("sleep");
        let c = LayoutConfig::new(8, 2, 2, (g / 2048) as usize, 256, 2);
        let fixed = LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .map_region(&p, &MemOptions::new())
            .build()
            .expect("layout");
        let r = a.register(fixed).expect("register");
        let e = p
            .sleep(&SleepPolicy::offload_all())
            .expect_err("registered memory refuses sleep");
        assert!(matches!(e, Error::SleepRefused { .. }), "{e}");
        assert!(e.to_string().contains("RegisteredLayout"), "{e}");
        assert!(!p.is_asleep());
        drop(r);
        assert_eq!(a.registrations(), 0);
        let l = LayoutBuilder::new()
            .config(c)
            .layer_separate(BlockDim::Second)
            .elastic(&p, &MemOptions::new())
            .hook(a.mapping_hook())
            .build()
            .expect("elastic");
        l.ensure_backed([0, 1, 4]).expect("back");
        let before = (a.registrations(), a.registered_bytes());
        assert!(before.0 > 0);
        p.sleep(&SleepPolicy::offload_all()).expect("sleep");
        assert_eq!(
            a.registrations(),
            0,
            "every registration went before the unmap"
        );
        p.wake(AfterWake::KeepHostMemory).expect("wake");
        assert_eq!(
            (a.registrations(), a.registered_bytes()),
            before,
            "registrations renewed after wake"
        );
        l.release([0, 1, 4]).expect("release");
        assert_eq!(a.registrations(), 0);
    }

    pub fn registration_lifetime_every_path(backend: Arc<dyn Backend>) {
        let g = backend.info().granularity as u64;
        let fault = Arc::new(FaultInjector::new(backend.clone()));
        let fb: Arc<dyn Backend> = fault.clone();
        let p = pool(&fb, 64 * g);
        let a = agent("lifetime");
        // Block second, unit g/4: a block is 4 units on 4 pages; 4 blocks share each page.
        let c = LayoutConfig::new(8, 2, 2, (g / 2048) as usize, 256, 2);
        assert_eq!(c.sizes().expect("sizes").unit, g / 4);
        let l = LayoutBuilder::new()
            .config(c)
            .layer_separate(BlockDim::Second)
            .elastic(&p, &MemOptions::new())
            .hook(a.mapping_hook())
            .build()
            .expect("elastic");
        let agree = |what: &str| {
            let s = l.stats();
            assert_eq!(
                a.registrations(),
                s.mapped_pages,
                "{what}: one registration per mapped page"
            );
            assert_eq!(a.registered_bytes(), s.mapped_bytes, "{what}");
            for (at, len) in l.backing().mapped_runs() {
                for chunk in l.chunks_in(at, len) {
                    let d = a
                        .descriptors(elastic_vmm::layout::MemoryView {
                            addr: l.addr() + chunk.offset,
                            len: chunk.size,
                        })
                        .expect("every mapped chunk is registered");
                    assert_eq!(d.len(), 1, "{what}: one registration per chunk");
                }
            }
        };
        assert_eq!(a.registrations(), 0);
        l.ensure_backed([0, 1, 4]).expect("back");
        agree("backed 0, 1, 4");
        assert_eq!(
            a.registrations(),
            8,
            "pages of blocks 0..4 and 4..8, per layer and outer"
        );
        l.release([0]).expect("release");
        agree("released 0 (shares with 1)");
        assert_eq!(a.registrations(), 8);
        l.release([4]).expect("release");
        agree("released 4");
        assert_eq!(a.registrations(), 4);
        // Rollback: the second of four page runs fails to map.
        fault.fail_nth(DriverCall::Map, 2);
        l.ensure_backed([5]).expect_err("injected failure");
        agree("after rollback");
        assert_eq!(
            a.registrations(),
            4,
            "registrations of the rolled back pages dropped"
        );
        fault.clear();
        l.ensure_backed([5, 6]).expect("back");
        agree("backed 5, 6");
        // Drop after the pool handle went: the layout's region keeps the pool alive.
        drop(p);
        assert_eq!(a.registrations(), 8);
        drop(l);
        assert_eq!(a.registrations(), 0, "dropped with the layout");
        assert_eq!(
            backend.physical_bytes().expect("held"),
            0,
            "pool gone, memory given back"
        );
    }

    /// Measure one transfer and check it moved what was asked.
    fn timed(
        op: TransferOp,
        a: &NixlAgent,
        src: &dyn KvLayout,
        sb: &[usize],
        b: &NixlAgent,
        dst: &dyn KvLayout,
        db: &[usize],
    ) -> TransferReport {
        let r = transfer_blocks(
            op,
            BlockSet {
                agent: a,
                layout: src,
                blocks: sb,
            },
            BlockSet {
                agent: b,
                layout: dst,
                blocks: db,
            },
            Duration::from_secs(120),
        )
        .expect("transfer");
        let block = src.views().geometry().sizes().block;
        assert_eq!(
            r.bytes,
            block * sb.len() as u64,
            "{op:?} moved every byte of the blocks"
        );
        r
    }

    /// Blocks of a fully contiguous layout registered with agent A are written with a NIXL WRITE
    /// into blocks of an elastic block-second layout of agent B and verified byte for byte,
    /// then read back with a READ into other blocks of A and verified. After B releases a
    /// block, NIXL itself (fresh metadata) refuses descriptors on its memory.
    pub fn write_then_read_byte_exact(backend: Arc<dyn Backend>) {
        let g = backend.info().granularity as u64;
        let p = pool(&backend, 256 * g);
        let (a, b) = (agent("write-a"), agent("write-b"));
        let (src, dst) = straddling_pair(&p, g, &a, &b);
        let from = [0, 1, 2, 3, 9, 10, 15];
        // Block 0 of B is alone on its pages (blocks 1 and 2 stay unbacked).
        let to = [12, 13, 14, 15, 6, 7, 0];
        fill(&*src, &from, 42);
        dst.ensure_backed(to).expect("back dst");
        let w = timed(TransferOp::Write, &a, &src, &from, &b, &dst, &to);
        assert!(w.metadata_loaded, "first transfer loads B's metadata");
        assert!(
            w.descriptors > 1,
            "split at chunks and non-contiguous units"
        );
        check(&dst, &to, &from, 42, "after WRITE");
        // READ back into other blocks of A.
        let back = [4, 5, 6, 7, 8, 11, 12];
        let r = timed(TransferOp::Read, &a, &src, &back, &b, &dst, &to);
        assert!(!r.metadata_loaded, "B's registrations did not change");
        check(&*src, &back, &from, 42, "after READ");
        println!(
            "NIXL {} -> {} ({:?}): WRITE {} B in {} descriptors, {:?}; READ {:?}",
            a.name(),
            b.name(),
            backend.info().memory_kind,
            w.bytes,
            w.descriptors,
            w.elapsed,
            r.elapsed
        );
        // Release B's block 0 (its pages hold no other backed block), then transfer again:
        // the metadata is reloaded, and NIXL refuses the released memory itself.
        let released = dst.unit(0, 0, 0).expect("unit");
        let before = b.registrations();
        dst.release([0]).expect("release");
        assert!(b.registrations() < before, "pages of block 0 deregistered");
        let again = timed(TransferOp::Write, &a, &src, &from[..2], &b, &dst, &to[..2]);
        assert!(
            again.metadata_loaded,
            "B's registrations changed: metadata reloaded"
        );
        let src_unit = src.unit(0, 0, 0).expect("unit");
        let kept = dst.unit(12, 0, 0).expect("unit");
        let (smem, sdev) = expected_mem(&backend);
        let raw = |remote: elastic_vmm::layout::MemoryView| {
            let mut l = sys::XferDescList::new(smem).expect("list");
            l.add_desc(src_unit.addr as usize, src_unit.len as usize, sdev);
            let mut r = sys::XferDescList::new(smem).expect("list");
            r.add_desc(remote.addr as usize, remote.len as usize, sdev);
            a.raw()
                .create_xfer_req(sys::XferOp::Write, &l, &r, b.name(), None)
                .map(drop)
        };
        assert!(raw(kept).is_ok(), "NIXL accepts B's registered memory");
        assert!(raw(released).is_err(), "NIXL refuses memory B deregistered");
        drop(dst);
        assert_eq!(b.registrations(), 0);
        drop(src);
        assert_eq!(a.registrations(), 0);
        held_matches(&backend, &p);
    }

    /// A transfer touching an unbacked block (either side) is refused with the block's number
    /// before NIXL is called (the remote's metadata is not even loaded); bad pairings are
    /// errors too.
    pub fn unbacked_block_refused_before_nixl(backend: Arc<dyn Backend>) {
        let g = backend.info().granularity as u64;
        let p = pool(&backend, 64 * g);
        let (a, b) = (agent("refuse-a"), agent("refuse-b"));
        let c = LayoutConfig::new(8, 2, 2, 16, 128, 2);
        let src = a
            .register(
                LayoutBuilder::new()
                    .config(c)
                    .layer_separate(BlockDim::First)
                    .allocate(&p, &MemOptions::new())
                    .build()
                    .expect("src"),
            )
            .expect("register");
        let dst = LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .elastic(&p, &MemOptions::new())
            .hook(b.mapping_hook())
            .build()
            .expect("dst");
        dst.ensure_backed([0, 1]).expect("back");
        let go = |op, s: &dyn KvLayout, sb: &[usize], d: &dyn KvLayout, db: &[usize]| {
            transfer_blocks(
                op,
                BlockSet {
                    agent: &a,
                    layout: s,
                    blocks: sb,
                },
                BlockSet {
                    agent: &b,
                    layout: d,
                    blocks: db,
                },
                Duration::from_secs(30),
            )
        };
        match go(TransferOp::Write, &src, &[0, 1, 2], &dst, &[0, 1, 2]) {
            Err(Error::BlockNotBacked {
                side,
                block,
                blocks,
            }) => assert_eq!((side, block, blocks), ("remote", 2, 3)),
            other => panic!("expected BlockNotBacked, got {other:?}"),
        }
        // The local side is checked too: B initiates from its elastic layout.
        match transfer_blocks(
            TransferOp::Read,
            BlockSet {
                agent: &b,
                layout: &dst,
                blocks: &[1, 7],
            },
            BlockSet {
                agent: &a,
                layout: &src,
                blocks: &[0, 1],
            },
            Duration::from_secs(30),
        ) {
            Err(Error::BlockNotBacked { side, block, .. }) => {
                assert_eq!((side, block), ("local", 7))
            }
            other => panic!("expected BlockNotBacked, got {other:?}"),
        }
        assert!(matches!(
            go(TransferOp::Write, &src, &[0, 1], &dst, &[0]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            go(TransferOp::Write, &src, &[0, 8], &dst, &[0, 1]),
            Err(Error::OutOfLayout {
                index: 8,
                count: 8,
                ..
            })
        ));
        let other = LayoutBuilder::new()
            .config(LayoutConfig::new(8, 2, 1, 16, 128, 2))
            .fully_contiguous()
            .allocate(&p, &MemOptions::new())
            .build()
            .expect("other");
        let other = b.register(other).expect("register");
        let m = match go(TransferOp::Write, &src, &[0], &other, &[0]) {
            Err(Error::InvalidLayout(m)) => m,
            r => panic!("expected InvalidLayout, got {r:?}"),
        };
        assert!(
            m.contains("2 layers x 2 outer") && m.contains("2 x 1"),
            "{m}"
        );
        // None of that reached NIXL: the first real transfer is the one that loads metadata.
        fill(&*src, &[0, 1], 9);
        let t = Instant::now();
        let r = go(TransferOp::Write, &src, &[0, 1], &dst, &[0, 1]).expect("transfer");
        assert!(r.metadata_loaded, "no refused transfer loaded B's metadata");
        check(&dst, &[0, 1], &[0, 1], 9, "after the refusals");
        println!(
            "first transfer after refusals: {:?} including metadata load",
            t.elapsed()
        );
        drop((src, dst, other));
        assert_eq!((a.registrations(), b.registrations()), (0, 0));
    }

    impl Bytes for elastic_vmm::nixl::RegisteredLayout {
        fn views(&self) -> &elastic_vmm::layout::LayoutViews {
            elastic_vmm::layout::Layout::views(self)
        }
        fn put(&self, addr: u64, data: &[u8]) -> elastic_vmm::Result<()> {
            Bytes::put(&**self, addr, data)
        }
        fn get(&self, addr: u64, out: &mut [u8]) -> elastic_vmm::Result<()> {
            Bytes::get(&**self, addr, out)
        }
    }

    /// The layout a transfer moves, for test types that wrap one (`KvLayout` is sealed).
    pub trait AsKv {
        fn kv(&self) -> &dyn KvLayout;
    }

    impl AsKv for elastic_vmm::nixl::RegisteredLayout {
        fn kv(&self) -> &dyn KvLayout {
            self
        }
    }

    impl AsKv for elastic_vmm::layout::ElasticLayout {
        fn kv(&self) -> &dyn KvLayout {
            self
        }
    }

    /// WRITE every block of `src` (agent `a`) into `dst` (agent `b`), then READ them all back,
    /// each verified byte for byte; prints and returns GB/s of each.
    pub fn measure<S: Bytes + AsKv, D: Bytes + AsKv>(
        what: &str,
        a: &NixlAgent,
        src: &S,
        b: &NixlAgent,
        dst: &D,
    ) -> (f64, f64) {
        let all: Vec<usize> = (0..src.kv().views().num_blocks()).collect();
        fill(src, &all, 1);
        // Warm-up (connection, metadata), then the measured passes.
        let (sk, dk) = (src.kv(), dst.kv());
        timed(TransferOp::Write, a, sk, &all[..1], b, dk, &all[..1]);
        let w = timed(TransferOp::Write, a, sk, &all, b, dk, &all);
        check(dst, &all, &all, 1, "bandwidth WRITE");
        fill(dst, &all, 2);
        let r = timed(TransferOp::Read, a, sk, &all, b, dk, &all);
        check(src, &all, &all, 2, "bandwidth READ");
        let gbs = |t: &TransferReport| t.bytes as f64 / t.elapsed.as_secs_f64() / 1e9;
        println!(
            "NIXL {what}: {} MiB in {} + {} descriptors: WRITE {:.2} GB/s ({:?}), READ {:.2} GB/s ({:?}), byte-exact",
            w.bytes >> 20,
            w.descriptors,
            r.descriptors,
            gbs(&w),
            w.elapsed,
            gbs(&r),
            r.elapsed
        );
        (gbs(&w), gbs(&r))
    }

    /// The config `bandwidth` moves: 1 MiB blocks (4 layers x K/V x 16 tokens x 4096 x 2 bytes).
    pub fn bandwidth_config(bytes: u64) -> LayoutConfig {
        LayoutConfig::new((bytes >> 20) as usize, 4, 2, 16, 4096, 2)
    }

    /// The layouts `bandwidth` moves between: `bytes` of a fully contiguous layout of `p`,
    /// registered with `a`, and an elastic layer-separate one backed in full, registering
    /// with `b`.
    pub fn bandwidth_layouts(
        p: &elastic_vmm::Pool,
        bytes: u64,
        a: &NixlAgent,
        b: &NixlAgent,
    ) -> (
        elastic_vmm::nixl::RegisteredLayout,
        elastic_vmm::layout::ElasticLayout,
    ) {
        let c = bandwidth_config(bytes);
        let src = a
            .register(
                LayoutBuilder::new()
                    .config(c)
                    .fully_contiguous()
                    .map_region(p, &MemOptions::new())
                    .build()
                    .expect("src"),
            )
            .expect("register");
        let dst = LayoutBuilder::new()
            .config(c)
            .layer_separate(BlockDim::First)
            .elastic(p, &MemOptions::new())
            .hook(b.mapping_hook())
            .build()
            .expect("dst");
        dst.ensure_backed(0..c.num_blocks).expect("back");
        (src, dst)
    }

    /// Bandwidth of WRITE and READ of `bytes` from a fully contiguous layout mapped in full to
    /// an elastic layer-separate one, both in pool memory of `backend`, registered per chunk.
    pub fn bandwidth(backend: Arc<dyn Backend>, bytes: u64) -> (f64, f64) {
        let g = backend.info().granularity as u64;
        let p = pool(&backend, 4 * bytes + 64 * g);
        let (a, b) = (agent("bw-a"), agent("bw-b"));
        let (src, dst) = bandwidth_layouts(&p, bytes, &a, &b);
        let what = format!(
            "{:?} pool memory ({} + {} registrations)",
            backend.info().memory_kind,
            a.registrations(),
            b.registrations()
        );
        measure(&what, &a, &src, &b, &dst)
    }

    /// Blocks are pinned for the whole of a transfer: a release that lands while NIXL moves
    /// them is refused with an error naming the transfer, and changes nothing. Each round, a
    /// thread tries to release a block at a random moment of a 32 MiB WRITE (and backs it again
    /// if it could). The pins certainly cover `[t1 - elapsed, t0 + elapsed]` (posting starts
    /// after `t0`, completion is seen before `t1`): a release that succeeded wholly inside it
    /// went through a pin.
    pub fn transfer_pins_blocks_against_release(backend: Arc<dyn Backend>) {
        const ROUNDS: usize = 24;
        let g = backend.info().granularity as u64;
        let p = pool(&backend, 128 * g.max(1 << 20));
        let (a, b) = (agent("pins-a"), agent("pins-b"));
        // Units of 1 MiB, blocks of 4 MiB, 32 MiB per transfer.
        let c = LayoutConfig::new(8, 2, 2, 16, 32768, 2);
        let src = a
            .register(
                LayoutBuilder::new()
                    .config(c)
                    .fully_contiguous()
                    .map_region(&p, &MemOptions::new())
                    .build()
                    .expect("src"),
            )
            .expect("register src");
        let dst = LayoutBuilder::new()
            .config(c)
            .layer_separate(BlockDim::First)
            .elastic(&p, &MemOptions::new())
            .hook(b.mapping_hook())
            .build()
            .expect("dst");
        let blocks: Vec<usize> = (0..8).collect();
        dst.ensure_backed(0..8).expect("back");
        fill(&*src, &blocks, 77);
        let go = || {
            transfer_blocks(
                TransferOp::Write,
                BlockSet {
                    agent: &a,
                    layout: &src,
                    blocks: &blocks,
                },
                BlockSet {
                    agent: &b,
                    layout: &dst,
                    blocks: &blocks,
                },
                Duration::from_secs(60),
            )
        };
        go().expect("warm-up transfer (connects, loads metadata)");
        let warm = Instant::now();
        go().expect("warm transfer");
        // Release attempts spread over twice a warm transfer's time.
        let spread = (2 * warm.elapsed().as_micros() as u64).max(2000);
        let base = Instant::now();
        let (start, end) = (Barrier::new(2), Barrier::new(2));
        let mut transfers = Vec::new();
        let releases = std::thread::scope(|s| {
            let releaser = s.spawn(|| {
                let mut rng = Rng::new(99);
                let mut out = Vec::new();
                for round in 0..ROUNDS {
                    start.wait();
                    std::thread::sleep(Duration::from_micros(rng.below(spread)));
                    let blk = round % 8;
                    let r0 = base.elapsed();
                    let r = dst.release([blk]);
                    let r1 = base.elapsed();
                    if r.is_ok() {
                        dst.ensure_backed([blk]).expect("back again");
                    }
                    out.push((r0, r1, r));
                    end.wait();
                }
                out
            });
            for _ in 0..ROUNDS {
                start.wait();
                let t0 = base.elapsed();
                let r = go();
                transfers.push((t0, base.elapsed(), r));
                end.wait();
            }
            releaser.join().expect("releaser")
        });
        let (mut inside, mut refused, mut moved) = (0, 0, 0);
        for ((t0, t1, t), (r0, r1, r)) in transfers.iter().zip(&releases) {
            match t {
                Ok(_) => moved += 1,
                // The release came first: refused before any NIXL call.
                Err(Error::BlockNotBacked { side: "remote", .. }) => {}
                Err(e) => panic!("a transfer failed: {e}"),
            }
            match r {
                Ok(_) => {}
                Err(Error::BlockPinned { holder, .. }) => {
                    assert!(holder.contains("NIXL WRITE"), "{holder}");
                    refused += 1;
                }
                Err(e) => panic!("release: {e}"),
            }
            if let Ok(report) = t {
                let (lo, hi) = (t1.saturating_sub(report.elapsed), *t0 + report.elapsed);
                if *r0 >= lo && *r1 <= hi {
                    inside += 1;
                    assert!(
                        r.is_err(),
                        "a block was released at [{r0:?}, {r1:?}], while the transfer held it over [{lo:?}, {hi:?}]"
                    );
                }
            }
        }
        println!(
            "{ROUNDS} rounds: {moved} transfers, {refused} releases refused by their pins, {inside} releases inside a transfer"
        );
        assert!(
            inside > 0,
            "no release landed inside a transfer in {ROUNDS} rounds: the race was not exercised"
        );
        go().expect("after the race");
        check(&dst, &blocks, &blocks, 77, "after the race");
        assert_eq!(dst.stats().pinned_blocks, 0, "every pin went");
        drop(dst);
        drop(src);
        assert_eq!((a.registrations(), b.registrations()), (0, 0));
        held_matches(&backend, &p);
    }

    /// Every mapped chunk is registered and every registration lies in one page, also with
    /// pages of 3 granules backed in one run after a history that left chunks of 2 granules in
    /// the cache: a page released alone is deregistered and unmapped whole, with no
    /// unregistered hole left in its neighbours.
    pub fn registration_whole_pages(backend: Arc<dyn Backend>) {
        let g = backend.info().granularity as u64;
        let p = pool(&backend, 128 * g);
        let two = p
            .reserve_region_with(8 * g, &MemOptions::new().chunk(2 * g))
            .expect("scratch");
        two.map(0, 8 * g).expect("2-granule chunks");
        let one = p.reserve_region(4 * g).expect("scratch");
        one.map(0, 4 * g).expect("1-granule chunks");
        two.unmap(0, 8 * g).expect("to the cache");
        one.unmap(0, 4 * g).expect("to the cache");
        drop((two, one));
        let a = agent("pages");
        let c = LayoutConfig::new(12, 1, 1, 16, (g / 32) as usize, 2); // a block is g
        let page = 3 * g;
        let l = LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .elastic(&p, &MemOptions::new().chunk(page))
            .hook(a.mapping_hook())
            .build()
            .expect("elastic");
        let agree = |what: &str| {
            let mut chunks = 0;
            for (at, len) in l.backing().mapped_runs() {
                for chunk in l.chunks_in(at, len) {
                    assert_eq!(
                        chunk.offset / page,
                        (chunk.offset + chunk.size - 1) / page,
                        "{what}: {chunk:?} crosses a page"
                    );
                    let d = a
                        .descriptors(elastic_vmm::layout::MemoryView {
                            addr: l.addr() + chunk.offset,
                            len: chunk.size,
                        })
                        .unwrap_or_else(|e| {
                            panic!("{what}: a mapped chunk is not registered: {e}")
                        });
                    assert_eq!(d.len(), 1, "{what}: one registration per chunk");
                    chunks += 1;
                }
            }
            assert_eq!(
                a.registrations(),
                chunks,
                "{what}: registrations == mapped chunks"
            );
            assert_eq!(a.registered_bytes(), l.stats().mapped_bytes, "{what}");
        };
        l.ensure_backed(0..12).expect("4 pages in one run");
        agree("backed");
        let change = l.release(3..6).expect("page 1");
        assert_eq!(
            (change.bytes, change.left_mapped),
            (page, 0),
            "page 1 went whole"
        );
        agree("page 1 released");
        assert!(matches!(
            a.descriptors(elastic_vmm::layout::MemoryView {
                addr: l.addr() + page,
                len: page
            }),
            Err(Error::NotRegistered { .. })
        ));
        l.release(9..12).expect("page 3");
        agree("page 3 released");
        drop(l);
        assert_eq!(a.registrations(), 0);
        held_matches(&backend, &p);
    }

    /// A view whose end passes 2^64 is an error with its numbers, not a panic or a wrap.
    pub fn bad_views_are_errors(_backend: Arc<dyn Backend>) {
        let a = agent("views");
        match a.descriptors(elastic_vmm::layout::MemoryView {
            addr: u64::MAX - 10,
            len: 100,
        }) {
            Err(e @ Error::SizeOverflow { .. }) => {
                let m = e.to_string();
                assert!(m.contains("0xfffffffffffffff5") && m.contains("100"), "{m}");
            }
            other => panic!("expected SizeOverflow, got {other:?}"),
        }
        assert!(a
            .descriptors(elastic_vmm::layout::MemoryView { addr: 4096, len: 0 })
            .expect("empty view")
            .is_empty());
    }

    /// A transfer that times out while NIXL still runs it keeps both sides pinned: a release is
    /// refused (naming the transfer), and the source's registrations and memory outlive its
    /// handle, until NIXL reports the request finished; then the data is there, byte-exact,
    /// and everything goes. Needs transfers that run after the post call returns (UCX over
    /// TCP; the host target runs it in a child process with `UCX_TLS=tcp`).
    pub fn timed_out_transfer_keeps_blocks_pinned(backend: Arc<dyn Backend>) {
        let g = backend.info().granularity as u64;
        let p = pool(&backend, 256 * g.max(1 << 20));
        let (a, b) = (agent("timeout-a"), agent("timeout-b"));
        let c = LayoutConfig::new(64, 2, 2, 16, 8192, 2); // blocks of 1 MiB, 64 MiB
        let src = a
            .register(
                LayoutBuilder::new()
                    .config(c)
                    .fully_contiguous()
                    .map_region(&p, &MemOptions::new())
                    .build()
                    .expect("src"),
            )
            .expect("register src");
        let dst = LayoutBuilder::new()
            .config(c)
            .layer_separate(BlockDim::Second)
            .elastic(&p, &MemOptions::new())
            .hook(b.mapping_hook())
            .build()
            .expect("dst");
        let all: Vec<usize> = (0..64).collect();
        dst.ensure_backed(0..64).expect("back");
        fill(&*src, &all, 31);
        let mut parked = false;
        for _ in 0..10 {
            match transfer_blocks(
                TransferOp::Write,
                BlockSet {
                    agent: &a,
                    layout: &src,
                    blocks: &all,
                },
                BlockSet {
                    agent: &b,
                    layout: &dst,
                    blocks: &all,
                },
                Duration::ZERO,
            ) {
                Err(Error::TransferTimeout { bytes, .. }) => {
                    assert_eq!(bytes, 64 << 20);
                    if a.pending_transfers() == 1 {
                        parked = true;
                        break;
                    }
                }
                Ok(_) => {}
                Err(e) => panic!("transfer: {e}"),
            }
        }
        assert!(
            parked,
            "no transfer was still running after its post: this scenario needs UCX over TCP"
        );
        match dst.release([0]) {
            Err(Error::BlockPinned { block, holder, .. }) => {
                assert_eq!(block, 0);
                assert!(holder.contains("NIXL WRITE"), "{holder}");
            }
            other => panic!("a block under a running transfer must not be released, got {other:?}"),
        }
        assert_eq!(
            dst.stats().backed_blocks,
            64,
            "the refused release changed nothing"
        );
        let regs = a.registrations();
        assert!(regs > 0);
        drop(src);
        assert_eq!(
            a.registrations(),
            regs,
            "the source stays registered while the transfer may run"
        );
        let deadline = Instant::now() + Duration::from_secs(120);
        while a.reap_transfers() > 0 {
            assert!(Instant::now() < deadline, "the transfer never finished");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(a.pending_transfers(), 0);
        assert_eq!(
            a.registrations(),
            0,
            "the source went with the finished transfer"
        );
        check(&dst, &all, &all, 31, "after the timed-out WRITE finished");
        dst.release(0..64).expect("unpinned");
        drop(dst);
        assert_eq!(b.registrations(), 0);
        held_matches(&backend, &p);
    }
}
