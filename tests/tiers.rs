//! Storage kinds and tier moves on the host backend: system memory, pinned (mlock'd) memory,
//! real files on disk, caller memory's declared kind, and the tiers suite (also run on CUDA by
//! the GPU target).

#[path = "suite/mod.rs"]
mod suite;

use std::sync::Arc;

use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::layout::{LayoutBuilder, LayoutConfig, MemoryRange, StorageKind};
use elastic_vmm::{Backend, Error, MemoryKind};

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new(2 << 20).expect("host backend"))
}

crate::tiers_suite!(host);

fn config() -> LayoutConfig {
    LayoutConfig::new(8, 2, 2, 16, 64, 2) // 8 KiB blocks, 64 KiB
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("evmm-tiers-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A disk layout at a path: created and sized to the layout, kept after the layout goes and
/// reused with its contents; a smaller file and a path that cannot be created are refused
/// with the numbers, the file left as it was.
#[test]
fn disk_layouts_at_a_path() {
    let dir = scratch("disk");
    let path = dir.join("kv.bin");
    let c = config();
    let extent = 64 << 10;
    let l = LayoutBuilder::new()
        .config(c)
        .fully_contiguous()
        .disk(&path)
        .build()
        .expect("disk");
    assert_eq!(l.storage(), StorageKind::Disk);
    assert_eq!(l.file().expect("file").0, Some(path.as_path()));
    assert_eq!(std::fs::metadata(&path).expect("created").len(), extent);
    assert_eq!(
        l.block(1).expect("block")[0].addr,
        8 << 10,
        "views are file offsets"
    );
    drop(l);
    assert!(path.exists(), "the file stays");
    std::fs::write(&path, vec![7u8; extent as usize + 100]).expect("grow");
    let l = LayoutBuilder::new()
        .config(c)
        .fully_contiguous()
        .disk(&path)
        .build()
        .expect("larger file");
    drop(l);
    assert_eq!(
        std::fs::read(&path).expect("read")[..4],
        [7, 7, 7, 7],
        "contents kept"
    );
    std::fs::write(&path, vec![1u8; 1000]).expect("shrink");
    let e = LayoutBuilder::new()
        .config(c)
        .fully_contiguous()
        .disk(&path)
        .build()
        .expect_err("small");
    assert!(
        matches!(&e, Error::FileTooSmall { len: 1000, need, .. } if *need == extent),
        "{e}"
    );
    assert_eq!(
        std::fs::metadata(&path).expect("kept").len(),
        1000,
        "left as it was"
    );
    let bad = dir.join("no-such-dir").join("kv.bin");
    let e = LayoutBuilder::new()
        .config(c)
        .fully_contiguous()
        .disk(&bad)
        .build()
        .expect_err("no dir");
    assert!(
        matches!(
            &e,
            Error::Storage {
                storage: "disk",
                op: "create",
                ..
            }
        ) && e.to_string().contains("no-such-dir"),
        "{e}"
    );
    let e = LayoutBuilder::new()
        .config(c)
        .fully_contiguous()
        .disk_temp(dir.join("nope"))
        .build()
        .expect_err("no dir");
    assert!(e.to_string().contains("nope"), "{e}");
    std::fs::remove_dir_all(&dir).expect("clean up");
}

/// System and pinned memory are zeroed, page aligned, owned (their chunks are the layout);
/// pinned memory on the host backend is locked (VmLck grows) and NUMA-bound only where the
/// machine has several nodes.
#[test]
fn host_memory_kinds() {
    let pool = elastic_vmm::Pool::host(64 << 20).expect("pool");
    let c = LayoutConfig::new(64, 4, 2, 16, 128, 2); // 64 blocks of 32 KiB = 2 MiB
    let pinned = LayoutBuilder::new()
        .config(c)
        .fully_contiguous()
        .pinned(&pool, true)
        .build()
        .expect("pinned");
    assert_eq!(pinned.storage(), StorageKind::Pinned);
    // VmLck is the whole process's, and other tests of this binary lock and unlock memory
    // meanwhile: the layout's own mapping says what is locked (smaps' `Locked:` line).
    let at = pinned.views().regions()[0].addr;
    let locked_kb = locked_kb_at(at);
    assert!(
        locked_kb >= 2048,
        "2 MiB locked: {locked_kb} kB in the layout's mapping"
    );
    let nodes = std::fs::read_to_string("/sys/devices/system/node/online").unwrap_or_default();
    if nodes.trim() == "0" {
        assert_eq!(pinned.numa_node(), None, "one node: nothing to bind");
    }
    let sys = LayoutBuilder::new()
        .config(c)
        .layer_separate(elastic_vmm::layout::BlockDim::First)
        .system()
        .build()
        .expect("system");
    assert_eq!(sys.storage(), StorageKind::System);
    for l in [&pinned, &sys] {
        let chunks = l.chunks();
        assert_eq!(chunks.len(), 1);
        assert_eq!(chunks[0].addr % 4096, 0);
        assert!(l.pool().is_none());
        // SAFETY: the layout's own memory, 2 MiB long, nobody else uses it.
        let bytes = unsafe {
            std::slice::from_raw_parts(chunks[0].addr as *const u8, chunks[0].len as usize)
        };
        assert!(bytes.iter().all(|&b| b == 0), "zeroed");
        let e = unsafe { l.write(chunks[0].addr, &[1]) }.expect_err("no pool copy path");
        assert!(e.to_string().contains("copy_blocks"), "{e}");
    }
    drop(pinned);
    assert_eq!(locked_kb_at(at), 0, "unlocked when the layout goes");
}

/// Kilobytes locked in the mapping holding `at` (smaps' `Locked:`), 0 where nothing is mapped.
fn locked_kb_at(at: u64) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
    let mut in_it = false;
    let mut kb = 0;
    for l in smaps.lines() {
        let range = l.split_once(' ').and_then(|(r, _)| r.split_once('-'));
        if let Some((s, e)) = range {
            if let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) {
                in_it = s <= at && at < e;
                continue;
            }
        }
        if let Some(v) = l.strip_prefix("Locked:").filter(|_| in_it) {
            kb += v.trim().trim_end_matches(" kB").parse::<u64>().expect("kB");
        }
    }
    kb
}

/// Caller memory's declared kind, checked by the backend that can tell: on the host backend
/// every address is host memory, so memory declared as a device's is refused.
#[test]
fn caller_memory_kind_is_checked() {
    let pool = elastic_vmm::Pool::host(64 << 20).expect("pool");
    let owner = pool.allocate(1 << 20).expect("memory");
    let c = config();
    let range = |kind, device| MemoryRange {
        addr: owner.addr(),
        len: 64 << 10,
        kind,
        device,
    };
    // SAFETY: the range lies in `owner`, which outlives the layouts (dropped at once).
    let build = |r: MemoryRange| {
        unsafe {
            LayoutBuilder::new()
                .config(c)
                .fully_contiguous()
                .regions(vec![r])
        }
        .checked_by(pool.backend().clone())
        .build()
    };
    let e = build(range(MemoryKind::Device, Some(0))).expect_err("declared device");
    assert!(
        e.to_string().contains("declared Device")
            && e.to_string().contains("driver says it is Host"),
        "{e}"
    );
    build(range(MemoryKind::Host, None)).expect("host memory declared host");
}

/// The staging side of a host tier, counted: a tier on a counting adaptor (every driver call
/// it makes) and models whose staging copies a fault adaptor counts (none armed).
mod staging_through_a_tier {
    use std::sync::Arc;

    use elastic_vmm::backend::counting::Counting;
    use elastic_vmm::backend::host::HostBackend;
    use elastic_vmm::backend::testing::FaultInjector;
    use elastic_vmm::{AfterWake, Allocation, Backend, DriverCall, Pool, PoolConfig, SleepPolicy};

    const G: usize = 64 << 10;
    const MODEL: usize = 1 << 20;

    fn tier(budget: u64) -> (Pool, Arc<Counting>) {
        let b = Arc::new(Counting::new(Arc::new(
            HostBackend::locked(G).expect("locked host backend"),
        )));
        let p = Pool::new(
            b.clone() as Arc<dyn Backend>,
            PoolConfig::new(64 << 20)
                .physical_limit(budget)
                .name("tier"),
        )
        .expect("tier");
        (p, b)
    }

    /// A model: a pool staging through `tier`, `MODEL` bytes of a pattern of its own.
    fn model(tier: &Pool, tag: u8) -> (Pool, Arc<FaultInjector>, Allocation, Vec<u8>) {
        let b = Arc::new(FaultInjector::new(Arc::new(
            HostBackend::new(G).expect("host backend"),
        )));
        let p = Pool::new(b.clone() as Arc<dyn Backend>, PoolConfig::new(16 << 20)).expect("pool");
        p.stage_through(Some(tier.clone())).expect("stage through");
        let mut a = p.allocate(MODEL).expect("memory");
        let data: Vec<u8> = (0..MODEL)
            .map(|i| (i as u8).wrapping_mul(tag) ^ tag)
            .collect();
        a.write(0, &data).expect("write");
        (p, b, a, data)
    }

    fn intact(a: &Allocation, data: &[u8]) -> bool {
        let mut back = vec![0u8; data.len()];
        a.read(0, &mut back).expect("read");
        back == data
    }

    /// The host memory a woken model gives back stays in the tier, mapped, as idle memory
    /// under its budget: the same model's next sleep, and another model's, take it with no
    /// driver call on the tier (before, each sleep mapped a fresh region of the tier and each
    /// wake unmapped it: two map/access calls and an unmap per chunk, every time, which on
    /// CUDA cost ~26 ms per GiB). Each sleep copies its memory in one run (one staging copy),
    /// contents come back byte-exact.
    #[test]
    fn a_woken_models_host_memory_serves_the_next_sleep_with_no_driver_call() {
        let (tier, calls) = tier(8 << 20);
        let (a, a_copies, aa, da) = model(&tier, 3);
        let (b, b_copies, ab, db) = model(&tier, 5);
        let offload = SleepPolicy::offload_all();
        // Cold: the tier grows for A's copy.
        let t0 = calls.counts();
        let r = a.sleep(&offload).expect("A sleeps");
        let cold = calls.counts().since(&t0);
        assert!(cold.get(DriverCall::Create) > 0, "the tier grew: {cold:?}");
        assert_eq!(a_copies.staging_copies(), 1, "one run, one copy: {r:?}");
        let t1 = calls.counts();
        a.wake(AfterWake::FreeHostMemory).expect("A wakes");
        assert!(intact(&aa, &da), "A byte-exact");
        assert_eq!(
            calls.counts().since(&t1).total(),
            0,
            "giving the buffer back costs the tier nothing"
        );
        assert!(
            tier.stats().idle() >= r.offloaded,
            "A's host memory stays in the tier: {:?}",
            tier.stats()
        );
        // Warm: A again, then B, through the same memory.
        for (name, p, copies, alloc, data) in [
            ("A", &a, &a_copies, &aa, &da),
            ("B", &b, &b_copies, &ab, &db),
        ] {
            let before = copies.staging_copies();
            let t = calls.counts();
            let r = p.sleep(&offload).expect("sleeps");
            p.wake(AfterWake::FreeHostMemory).expect("wakes");
            let warm = calls.counts().since(&t);
            assert_eq!(
                warm.total(),
                0,
                "{name}: no driver call on the tier: {warm:?}"
            );
            assert!(r.offloaded >= MODEL as u64, "{name}: {r:?}");
            assert_eq!(
                copies.staging_copies() - before,
                2,
                "{name}: one copy out, one back"
            );
            assert!(intact(alloc, data), "{name} byte-exact");
        }
        assert_eq!(
            tier.stats().driver_calls.get(DriverCall::Create),
            cold.get(DriverCall::Create),
            "every chunk the tier made, it made for A's first sleep"
        );
        tier.audit().expect("tier audit");
        a.audit().expect("A audit");
        b.audit().expect("B audit");
    }

    /// `Pool::prefill` makes a tier ready once for every model of the process: after it, two
    /// models sleeping at the same time (threads) take their buffers from the prefilled memory
    /// with no driver call on the tier; a second prefill of no more makes nothing.
    #[test]
    fn a_prefilled_tier_serves_sleeps_with_no_driver_call() {
        let (tier, calls) = tier(8 << 20);
        let made = tier.prefill(4 * MODEL as u64).expect("prefill");
        assert!(made >= 4 * MODEL as u64, "{made} bytes made");
        assert!(tier.stats().idle() >= 4 * MODEL as u64);
        let t0 = calls.counts();
        assert_eq!(tier.prefill(2 * MODEL as u64).expect("again"), 0);
        let models: Vec<_> = (1..=3).map(|t| model(&tier, t)).collect();
        std::thread::scope(|s| {
            for (p, _, _, _) in &models {
                s.spawn(move || {
                    for _ in 0..5 {
                        p.sleep(&SleepPolicy::offload_all()).expect("sleeps");
                        p.wake(AfterWake::FreeHostMemory).expect("wakes");
                    }
                });
            }
        });
        let d = calls.counts().since(&t0);
        assert_eq!(d.total(), 0, "nothing made, mapped or given back: {d:?}");
        for (p, _, a, data) in &models {
            assert!(intact(a, data), "byte-exact");
            p.audit().expect("audit");
        }
        tier.audit().expect("tier audit");
        let e = tier.prefill(64 << 20).expect_err("over the budget");
        assert!(e.is_out_of_memory(), "{e}");
    }

    /// Idle staging memory counts against the tier's budget but never stands in the way: a
    /// tier at its budget gives it back when a layout (or anything else) needs the room,
    /// instead of refusing.
    #[test]
    fn a_tier_at_its_budget_gives_idle_staging_memory_back_when_asked() {
        let budget = 3 * MODEL as u64;
        let (tier, _) = tier(budget);
        let (a, _, aa, da) = model(&tier, 7);
        a.sleep(&SleepPolicy::offload_all()).expect("A sleeps");
        a.wake(AfterWake::FreeHostMemory).expect("A wakes");
        let idle = tier.stats().idle();
        assert!(idle >= MODEL as u64, "{:?}", tier.stats());
        // A region of the rest of the budget and then some: only fits with the idle memory gone.
        let want = budget - idle + MODEL as u64;
        let want = want.div_ceil(G as u64) * G as u64;
        let region = tier.reserve_region(want).expect("region");
        region
            .map(0, want)
            .expect("the idle staging memory makes room");
        assert!(tier.stats().peak_physical <= budget, "{:?}", tier.stats());
        drop(region);
        // A sleeps again: the tier grows back.
        a.sleep(&SleepPolicy::offload_all())
            .expect("A sleeps again");
        a.wake(AfterWake::FreeHostMemory).expect("A wakes again");
        assert!(intact(&aa, &da), "byte-exact");
        tier.audit().expect("tier audit");
    }
}
