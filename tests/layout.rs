//! KV-cache layouts: the arithmetic (sizes, offsets per kind, 512-byte alignment, merged runs,
//! validation with the numbers in the errors), and the generic suite on the host backend.

#[path = "suite/mod.rs"]
mod suite;

use std::sync::Arc;

use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::layout::{
    BlockDim, LayoutBuilder, LayoutConfig, LayoutGeometry, LayoutKind, MemoryRange, MemoryView,
    Span, REGION_ALIGNMENT,
};
use elastic_vmm::{Backend, BlockGeometry, Error, MemOptions, MemoryKind};

use suite::layout::{expected_place, KINDS};

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new(2 << 20).expect("host backend"))
}

crate::layout_suite!(host);

#[test]
fn sizes_follow_the_dimensions() {
    let c = LayoutConfig::new(100, 32, 2, 16, 1024, 2);
    let s = c.sizes().expect("valid");
    assert_eq!(s.unit, 16 * 1024 * 2);
    assert_eq!(s.block_per_layer, 2 * s.unit);
    assert_eq!(s.block, 32 * 2 * s.unit);
    assert_eq!(s.layer, 100 * 2 * s.unit);
    assert_eq!(s.total, 100 * s.block);
    for kind in KINDS {
        let g = LayoutGeometry::new(c, kind).expect("geometry");
        assert_eq!(g.num_regions(), kind.num_regions(32));
        let data: u64 = g.region_bytes() * g.num_regions() as u64;
        assert_eq!(data, s.total, "{kind}: regions hold exactly the data");
    }
}

/// Every unit of every kind lies where the independent formula says, regions start on
/// 512-byte boundaries even when a region's size is not a multiple of 512, and units tile
/// each region without gap or overlap.
#[test]
fn offsets_per_kind_and_alignment() {
    // Unit 3 * 5 * 2 = 30 bytes: region sizes far from multiples of 512.
    let c = LayoutConfig::new(7, 3, 2, 3, 5, 2);
    for kind in KINDS {
        let g = LayoutGeometry::new(c, kind).expect("geometry");
        let region = g.region_bytes();
        for r in 0..g.num_regions() {
            assert_eq!(
                g.region_offset(r) % REGION_ALIGNMENT,
                0,
                "{kind}: region {r}"
            );
            if r > 0 {
                assert!(g.region_offset(r) >= g.region_offset(r - 1) + region);
                assert!(g.region_offset(r) < g.region_offset(r - 1) + region + REGION_ALIGNMENT);
            }
        }
        assert_eq!(
            g.extent(),
            g.region_offset(g.num_regions() - 1) + region,
            "{kind}: extent"
        );
        let mut seen = vec![vec![false; region as usize]; g.num_regions()];
        for b in 0..7 {
            for l in 0..3 {
                for o in 0..2 {
                    let u = g.unit(b, l, o).expect("unit");
                    let (er, eo) = expected_place(kind, &c, b, l, o);
                    assert_eq!(
                        (u.region, u.offset, u.len),
                        (er, eo, 30),
                        "{kind}: ({b},{l},{o})"
                    );
                    for x in &mut seen[u.region][u.offset as usize..(u.offset + u.len) as usize] {
                        assert!(!*x, "{kind}: units overlap at ({b},{l},{o})");
                        *x = true;
                    }
                }
            }
        }
        assert!(
            seen.iter().flatten().all(|&x| x),
            "{kind}: units tile the regions"
        );
    }
    // Concrete numbers for block second: (block 2, layer 1, V) = index 1 * 7 + 2 = 9 in region 1.
    let g = LayoutGeometry::new(c, LayoutKind::LayerSeparate(BlockDim::Second)).expect("g");
    assert_eq!(
        g.unit(2, 1, 1).expect("unit"),
        Span {
            region: 1,
            offset: 9 * 30,
            len: 30
        }
    );
    assert_eq!(g.region_bytes(), 7 * 2 * 30);
    assert_eq!(g.region_offset(1), 512, "420 bytes padded to 512");
    assert_eq!(g.region_offset(2), 1024);
}

/// Runs of consecutive blocks merge into as few spans as each kind allows; a block's spans
/// (what elastic backing maps) are the run of one.
#[test]
fn merged_runs() {
    let c = LayoutConfig::new(10, 4, 2, 16, 8, 1); // unit 128
    let fc = LayoutGeometry::new(c, LayoutKind::FullyContiguous).expect("fc");
    assert_eq!(
        fc.blocks(3, 4).expect("run"),
        vec![Span {
            region: 0,
            offset: 3 * 1024,
            len: 4 * 1024
        }]
    );
    let bf = LayoutGeometry::new(c, LayoutKind::LayerSeparate(BlockDim::First)).expect("bf");
    let run = bf.blocks(3, 4).expect("run");
    assert_eq!(run.len(), 4, "one span per layer");
    assert!(run.iter().enumerate().all(|(l, s)| *s
        == Span {
            region: l,
            offset: 3 * 256,
            len: 4 * 256
        }));
    let bs = LayoutGeometry::new(c, LayoutKind::LayerSeparate(BlockDim::Second)).expect("bs");
    let run = bs.blocks(3, 4).expect("run");
    assert_eq!(run.len(), 8, "one span per layer and outer index");
    assert_eq!(
        run[1],
        Span {
            region: 0,
            offset: (10 + 3) * 128,
            len: 4 * 128
        }
    );
    assert_eq!(
        run[7],
        Span {
            region: 3,
            offset: (10 + 3) * 128,
            len: 4 * 128
        }
    );
    // BlockGeometry: spans relative to the start of one range, regions at their offsets.
    let mut spans = Vec::new();
    bs.block_spans(9, &mut spans);
    assert_eq!(spans.len(), 8);
    assert_eq!(spans[3], (bs.region_offset(1) + (10 + 9) * 128, 128));
    assert_eq!(BlockGeometry::extent(&bs).expect("extent"), bs.extent());
    // Out of range runs are errors with the numbers.
    match fc.blocks(8, 3) {
        Err(Error::OutOfLayout { what, index, count }) => {
            assert_eq!((what, index, count), ("block", 10, 10))
        }
        other => panic!("expected OutOfLayout, got {other:?}"),
    }
    assert!(matches!(fc.blocks(0, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        fc.blocks(usize::MAX, 2),
        Err(Error::OutOfLayout { .. })
    ));
    match fc.unit(0, 4, 0) {
        Err(e @ Error::OutOfLayout { .. }) => {
            assert_eq!(e.to_string(), "layer 4 does not exist: the layout has 4")
        }
        other => panic!("expected OutOfLayout, got {other:?}"),
    }
    assert!(matches!(
        fc.unit(0, 0, 2),
        Err(Error::OutOfLayout {
            what: "outer index",
            index: 2,
            count: 2
        })
    ));
}

/// Views in memory: runs split where indices stop being consecutive (host memory, no data).
#[test]
fn views_of_runs() {
    let pool = elastic_vmm::Pool::new(host(), elastic_vmm::PoolConfig::new(1 << 30)).expect("pool");
    let c = LayoutConfig::new(10, 2, 2, 16, 8, 1);
    let l = LayoutBuilder::new()
        .config(c)
        .layer_separate(BlockDim::First)
        .allocate(&pool, &MemOptions::new())
        .build()
        .expect("layout");
    let views = l.runs(&[0, 1, 2, 7, 8, 4]).expect("runs");
    assert_eq!(views.len(), 3 * 2, "three runs, two layers each");
    assert_eq!(views[0].len, 3 * 256);
    assert_eq!(views[2].addr, l.unit(7, 0, 0).expect("unit").addr);
    assert_eq!(views[5].len, 256);
    assert_eq!(l.units_of(&[3]).expect("units").len(), 4);
    assert!(matches!(
        l.runs(&[9, 10]),
        Err(Error::OutOfLayout { index: 10, .. })
    ));
}

/// Zero dimensions, a bad outer dimension and sizes that overflow 64 bits are errors naming
/// the numbers, at build, before any memory is taken.
#[test]
fn bad_configs_are_refused_with_numbers() {
    let ok = LayoutConfig::new(4, 2, 2, 16, 64, 2);
    type Zero = fn(&mut LayoutConfig);
    let fields: [(&str, Zero); 6] = [
        ("num_blocks", |c| c.num_blocks = 0),
        ("num_layers", |c| c.num_layers = 0),
        ("outer_dim", |c| c.outer_dim = 0),
        ("page_size", |c| c.page_size = 0),
        ("inner_dim", |c| c.inner_dim = 0),
        ("dtype_width_bytes", |c| c.dtype_width_bytes = 0),
    ];
    for (name, zero) in fields {
        let mut c = ok;
        zero(&mut c);
        match c.sizes() {
            Err(Error::InvalidLayout(m)) => assert!(m.contains(&format!("{name} is 0")), "{m}"),
            other => panic!("{name} = 0: expected InvalidLayout, got {other:?}"),
        }
    }
    let mut c = ok;
    c.outer_dim = 3;
    let e = c.sizes().expect_err("outer 3");
    assert!(e.to_string().contains("outer_dim is 3"), "{e}");
    // 2^40 blocks of 2^30 bytes: the total overflows.
    let huge = LayoutConfig::new(1 << 40, 1, 1, 1 << 10, 1 << 10, 1 << 10);
    match huge.sizes() {
        Err(e @ Error::SizeOverflow { .. }) => {
            let m = e.to_string();
            assert!(
                m.contains("1073741824") && m.contains("1099511627776"),
                "{m}"
            );
        }
        other => panic!("expected SizeOverflow, got {other:?}"),
    }
    let unit_overflow = LayoutConfig::new(1, 1, 1, usize::MAX, 2, 1);
    assert!(matches!(
        unit_overflow.sizes(),
        Err(Error::SizeOverflow { .. })
    ));
    // Fits in 64 bits but not in the pool: refused by the pool, nothing left behind.
    let pool = elastic_vmm::Pool::new(host(), elastic_vmm::PoolConfig::new(1 << 30)).expect("pool");
    let big = LayoutConfig::new(1 << 20, 2, 2, 16, 1024, 2);
    let e = LayoutBuilder::new()
        .config(big)
        .fully_contiguous()
        .elastic(&pool, &MemOptions::new())
        .build()
        .expect_err("too big");
    assert!(matches!(e, Error::OutOfAddressSpace { .. }), "{e}");
    let mut zero = ok;
    zero.num_layers = 0;
    let e = LayoutBuilder::new()
        .config(zero)
        .fully_contiguous()
        .allocate(&pool, &MemOptions::new())
        .build()
        .expect_err("zero");
    assert!(matches!(e, Error::InvalidLayout(_)), "{e}");
    let s = pool.stats();
    assert_eq!(
        (s.in_use, s.reserved_regions, s.mapped),
        (0, 0, 0),
        "nothing taken"
    );
}

/// Bad runs and views are errors with the numbers in them, never a panic or a wrap-around: an
/// empty run names its first block and the layout's size, a run past the end or past
/// `usize::MAX` names its numbers, a view whose end passes 2^64 says so.
#[test]
fn bad_runs_and_views_name_their_numbers() {
    let c = LayoutConfig::new(10, 4, 2, 16, 8, 1);
    let g = LayoutGeometry::new(c, LayoutKind::FullyContiguous).expect("geometry");
    match g.blocks(3, 0) {
        Err(e @ Error::InvalidArgument(_)) => {
            let m = e.to_string();
            assert!(
                m.contains("0 blocks from block 3") && m.contains("10 blocks"),
                "{m}"
            );
        }
        other => panic!("expected a refused empty run, got {other:?}"),
    }
    match g.blocks(5, usize::MAX) {
        Err(e @ Error::InvalidArgument(_)) => {
            let m = e.to_string();
            assert!(
                m.contains(&usize::MAX.to_string()) && m.contains("block 5"),
                "{m}"
            );
        }
        other => panic!("expected a refused run, got {other:?}"),
    }
    assert!(matches!(
        g.blocks(9, 2),
        Err(Error::OutOfLayout {
            index: 10,
            count: 10,
            ..
        })
    ));
    let v = MemoryView {
        addr: u64::MAX - 10,
        len: 100,
    };
    match v.end() {
        Err(e @ Error::SizeOverflow { .. }) => {
            let m = e.to_string();
            assert!(m.contains("0xfffffffffffffff5") && m.contains("100"), "{m}");
        }
        other => panic!("expected SizeOverflow, got {other:?}"),
    }
    assert_eq!(
        MemoryView {
            addr: 512,
            len: 100
        }
        .end()
        .expect("end"),
        612
    );
}

/// Caller regions share one storage kind: one memory kind and device for all, a device
/// ordinal of at least 0 for device memory, none for host memory; anything else is refused at
/// build with the numbers.
#[test]
fn caller_regions_share_one_storage_kind() {
    let pool = elastic_vmm::Pool::new(host(), elastic_vmm::PoolConfig::new(1 << 30)).expect("pool");
    let owner = pool.allocate(4 << 20).expect("caller memory");
    let c = LayoutConfig::new(4, 2, 1, 16, 64, 2); // layer region: 4 * 2048 = 8 KiB
    let range = |addr: u64, kind: MemoryKind, device: Option<i32>| MemoryRange {
        addr,
        len: 8 << 10,
        kind,
        device,
    };
    let build = |ranges: Vec<MemoryRange>| {
        // SAFETY: every range lies in `owner`, alive for the whole test, and `build` is the only
        // thing done with the layout (dropped at once).
        unsafe {
            LayoutBuilder::new()
                .config(c)
                .layer_separate(BlockDim::First)
                .regions(ranges)
        }
        .build()
    };
    let base = owner.addr();
    let host_ok = build(vec![
        range(base, MemoryKind::Host, None),
        range(base + (1 << 20), MemoryKind::Host, None),
    ])
    .expect("host memory, no device");
    assert_eq!(host_ok.memory_kind(), MemoryKind::Host);
    let refused = |ranges: Vec<MemoryRange>, want: &[&str]| match build(ranges) {
        Err(Error::InvalidLayout(m)) => {
            for w in want {
                assert!(m.contains(w), "{w:?} not in {m:?}");
            }
        }
        other => panic!("expected InvalidLayout ({want:?}), got {other:?}"),
    };
    refused(
        vec![
            range(base, MemoryKind::Device, Some(-1)),
            range(base + (1 << 20), MemoryKind::Device, Some(-1)),
        ],
        &["Device", "Some(-1)", "at least 0"],
    );
    refused(
        vec![
            range(base, MemoryKind::Host, Some(0)),
            range(base + (1 << 20), MemoryKind::Host, Some(0)),
        ],
        &["Host", "Some(0)"],
    );
    refused(
        vec![
            range(base, MemoryKind::Host, None),
            range(base + (1 << 20), MemoryKind::Device, Some(0)),
        ],
        &["region 1", "Device", "one storage kind"],
    );
    refused(
        vec![
            range(base, MemoryKind::Device, Some(0)),
            range(base + (1 << 20), MemoryKind::Device, Some(1)),
        ],
        &["region 1", "Some(1)", "one storage kind"],
    );
}

/// Layout memories take [`MemOptions`]: `zeroed` on a mapped region clears chunks the cache
/// hands back dirty, an option a memory does not take is refused by name at build.
#[test]
fn layout_memory_options() {
    let backend = host();
    let g = backend.info().granularity as u64;
    let p = elastic_vmm::Pool::new(backend.clone(), elastic_vmm::PoolConfig::new(1 << 30))
        .expect("pool");
    // Dirty chunks in the cache.
    p.map(0, 4 * g).expect("map");
    // SAFETY: mapped just above; nothing else uses it.
    unsafe { backend.copies().fill(p.base(), (4 * g) as usize, 0xAB) }.expect("fill");
    p.unmap(0, 4 * g).expect("to the cache");
    let c = LayoutConfig::new(4, 2, 2, 16, (g / 256) as usize, 2); // a block is g
    let opts = MemOptions::new().zeroed().chunk(g);
    let kv = LayoutBuilder::new()
        .config(c)
        .fully_contiguous()
        .map_region(&p, &opts)
        .build()
        .expect("zeroed region");
    assert_eq!(
        p.stats().driver_calls.get(elastic_vmm::DriverCall::Create),
        4
    );
    for b in 0..4 {
        for v in kv.block(b).expect("block") {
            let mut back = vec![1u8; v.len as usize];
            // SAFETY: the layout's region is mapped while `kv` lives.
            unsafe { backend.copies().read(v.addr, &mut back) }.expect("read");
            assert!(back.iter().all(|&x| x == 0), "block {b} not zeroed");
        }
    }
    drop(kv);
    let refused = |r: Result<(), Error>, option: &str| match r {
        Err(Error::OptionNotApplicable { option: o, .. }) => assert_eq!(o, option),
        other => panic!("`{option}` should be refused, got {other:?}"),
    };
    let b = || LayoutBuilder::new().config(c).fully_contiguous();
    let chunk = MemOptions::new().chunk(g);
    let name = MemOptions::new().name("n");
    refused(b().allocate(&p, &chunk).build().map(drop), "chunk");
    refused(b().map_region(&p, &name).build().map(drop), "name");
    refused(b().elastic(&p, &name).build().map(drop), "name");
    assert_eq!(p.stats().reserved_regions, 0, "refusals keep nothing");
}
