//! Storage kinds and tier moves over any backend: the pool side is the backend's memory (device
//! memory on CUDA), the host side pinned for it, the disk side a real file.

use std::sync::Arc;

use elastic_vmm::backend::testing::FaultInjector;
use elastic_vmm::layout::{
    copy_blocks, BlockDim, KvTiers, Layout, LayoutBuilder, LayoutConfig, LayoutKind, StorageKind,
};
use elastic_vmm::{
    AfterWake, Backend, Error, MemOptions, MemoryKind, Pool, PoolConfig, SleepPolicy,
};

use super::Rng;

/// Every test of the tiers suite, as `#[test]` functions over `$make()`.
#[macro_export]
macro_rules! tiers_suite {
    ($make:expr) => {
        $crate::suite_tests!(
            $make;
            mod tiers;
            blocks_round_trip_through_every_kind,
            moves_are_checked_before_any_copy,
            failed_moves_roll_back,
            tiers_under_many_threads,
            host_tier_moves_and_budget,
            sleep_stages_through_the_host_tier,
            a_prefilled_tier_serves_sleeps_with_no_driver_call,
            tier_pools_do_not_sleep_under_a_move,
            moves_start_in_stream_order_and_settle_at_wait,
        );
    };
}

const KINDS: [LayoutKind; 3] = [
    LayoutKind::FullyContiguous,
    LayoutKind::LayerSeparate(BlockDim::First),
    LayoutKind::LayerSeparate(BlockDim::Second),
];

/// 32 blocks of 2 layers x K/V x 16 tokens x 64 x 2 bytes = 8 KiB per block.
fn config(blocks: usize) -> LayoutConfig {
    LayoutConfig::new(blocks, 2, 2, 16, 64, 2)
}

fn pool(backend: &Arc<dyn Backend>) -> Pool {
    let g = backend.info().granularity;
    Pool::new(backend.clone(), PoolConfig::new(64 * g).growth_divisor(0)).expect("pool")
}

fn on_pool(p: &Pool, c: LayoutConfig, kind: LayoutKind) -> Layout {
    LayoutBuilder::new()
        .config(c)
        .kind(kind)
        .map_region(p, &MemOptions::new())
        .build()
        .expect("pool layout")
}

fn byte(tag: u64, i: u64) -> u8 {
    (tag.wrapping_mul(131).wrapping_add(i.wrapping_mul(7)) % 251) as u8
}

/// Fill `block` of a pool layout with a pattern of `tag`.
fn fill(l: &Layout, block: usize, tag: u64) {
    for (k, v) in l.block(block).expect("block").iter().enumerate() {
        let data: Vec<u8> = (0..v.len).map(|i| byte(tag, i + k as u64 * 977)).collect();
        // SAFETY: the view lies in the layout; nobody else uses it in these tests.
        unsafe { l.write(v.addr, &data) }.expect("write");
    }
}

/// Whether `block` of a pool layout holds `tag`'s pattern.
fn holds(l: &Layout, block: usize, tag: u64) -> bool {
    l.block(block)
        .expect("block")
        .iter()
        .enumerate()
        .all(|(k, v)| {
            let mut out = vec![0u8; v.len as usize];
            // SAFETY: as in `fill`.
            unsafe { l.read(v.addr, &mut out) }.expect("read");
            out.iter()
                .enumerate()
                .all(|(i, &b)| b == byte(tag, i as u64 + k as u64 * 977))
        })
}

/// Blocks go pool -> pinned -> disk -> system -> pinned -> pool byte-exact for every kind, runs
/// merged into one copy per view (fully contiguous: one per run); the kinds are what was asked.
pub fn blocks_round_trip_through_every_kind(backend: Arc<dyn Backend>) {
    let p = pool(&backend);
    let device = backend.info().memory_kind == MemoryKind::Device;
    let dir = std::env::temp_dir();
    for kind in KINDS {
        let c = config(32);
        let a = on_pool(&p, c, kind);
        let b = LayoutBuilder::new().config(c).kind(kind);
        let pinned = b.pinned(&p, true).build().expect("pinned");
        let disk = LayoutBuilder::new()
            .config(c)
            .kind(kind)
            .disk_temp(&dir)
            .build()
            .expect("disk");
        let sys = LayoutBuilder::new()
            .config(c)
            .kind(kind)
            .system()
            .build()
            .expect("system");
        let pool_kind = match backend.info().device_ordinal {
            Some(d) if device => StorageKind::Device(d),
            _ => StorageKind::System,
        };
        assert_eq!(
            [a.storage(), pinned.storage(), disk.storage(), sys.storage()],
            [
                pool_kind,
                StorageKind::Pinned,
                StorageKind::Disk,
                StorageKind::System
            ]
        );
        let (path, fd) = disk.file().expect("a file");
        assert!(path.is_none() && fd >= 0, "a temporary file, open");
        for blk in 0..32 {
            fill(&a, blk, blk as u64 + 1);
        }
        let src = [3usize, 4, 5, 6, 20, 9, 10];
        let at = [0usize, 1, 2, 3, 10, 30, 31];
        // SAFETY: the layouts are this test's own; nothing else touches them.
        let r = unsafe { copy_blocks(&a, &src, &pinned, &at) }.expect("pool -> pinned");
        let per_block = a.block(0).expect("block").len();
        assert_eq!(r.copies, 3 * per_block, "{kind}: three runs, merged");
        assert_eq!(r.bytes, 7 * c.sizes().expect("sizes").block);
        // SAFETY: as above.
        unsafe { copy_blocks(&pinned, &at, &disk, &[5, 6, 7, 8, 9, 10, 11]) }
            .expect("pinned -> disk");
        // SAFETY: as above.
        unsafe {
            copy_blocks(
                &disk,
                &[5, 6, 7, 8, 9, 10, 11],
                &sys,
                &[11, 12, 13, 14, 0, 1, 2],
            )
        }
        .expect("disk -> system");
        // Back through pinned memory to other blocks of the pool layout.
        // SAFETY: as above.
        unsafe {
            copy_blocks(
                &sys,
                &[11, 12, 13, 14, 0, 1, 2],
                &pinned,
                &[20, 21, 22, 23, 24, 25, 26],
            )
        }
        .expect("system -> pinned");
        let back = [24usize, 25, 26, 27, 28, 29, 31];
        // SAFETY: as above.
        unsafe { copy_blocks(&pinned, &[20, 21, 22, 23, 24, 25, 26], &a, &back) }
            .expect("pinned -> pool");
        for (i, &s) in src.iter().enumerate() {
            assert!(
                holds(&a, back[i], s as u64 + 1),
                "{kind}: block {s} came back to {}",
                back[i]
            );
        }
        for blk in [0usize, 1, 2, 7, 8, 11] {
            assert!(
                holds(&a, blk, blk as u64 + 1),
                "{kind}: block {blk} untouched"
            );
        }
        // System memory and the device: refused before any copy (not pinned for it).
        // SAFETY: refused before any copy, or a copy between this test's layouts.
        let r = unsafe { copy_blocks(&sys, &[0], &a, &[0]) };
        if device {
            let e = r.expect_err("system -> device");
            assert!(e.to_string().contains("pinned"), "{e}");
            // Device <-> disk: no GPUDirect Storage.
            // SAFETY: refused before any copy.
            let e = unsafe { copy_blocks(&a, &[0], &disk, &[0]) }.expect_err("device -> disk");
            assert!(e.to_string().contains("GPUDirect"), "{e}");
        } else {
            r.expect("host pool <-> system memory");
        }
    }
}

/// A geometry mismatch, unpaired lists, a block out of range, a destination named twice, disk
/// to disk: refused with the numbers, the destination untouched.
pub fn moves_are_checked_before_any_copy(backend: Arc<dyn Backend>) {
    let p = pool(&backend);
    let c = config(8);
    let a = on_pool(&p, c, LayoutKind::FullyContiguous);
    for blk in 0..8 {
        fill(&a, blk, 100 + blk as u64);
    }
    let pinned = LayoutBuilder::new()
        .config(c)
        .fully_contiguous()
        .pinned(&p, false)
        .build()
        .expect("pinned");
    let other = LayoutBuilder::new()
        .config(config(8))
        .layer_separate(BlockDim::First)
        .pinned(&p, false)
        .build()
        .expect("pinned, other kind");
    let small = LayoutBuilder::new()
        .config(config(4))
        .fully_contiguous()
        .pinned(&p, false)
        .build()
        .expect("pinned, fewer blocks");
    // SAFETY (every call): refused before any copy.
    let e = unsafe { copy_blocks(&pinned, &[0], &other, &[0]) }.expect_err("kind differs");
    assert!(matches!(e, Error::LayoutMismatch { .. }), "{e}");
    let e = unsafe { copy_blocks(&pinned, &[0], &small, &[0]) }.expect_err("blocks differ");
    assert!(
        e.to_string().contains("num_blocks: 8") && e.to_string().contains("num_blocks: 4"),
        "{e}"
    );
    let e = unsafe { copy_blocks(&pinned, &[0, 1], &a, &[0]) }.expect_err("unpaired");
    assert!(
        e.to_string().contains("2 source blocks, 1 destination"),
        "{e}"
    );
    let e = unsafe { copy_blocks(&pinned, &[0, 8], &a, &[0, 1]) }.expect_err("out of range");
    assert!(
        matches!(
            e,
            Error::OutOfLayout {
                index: 8,
                count: 8,
                ..
            }
        ),
        "{e}"
    );
    let e = unsafe { copy_blocks(&pinned, &[0, 1], &a, &[3, 3]) }.expect_err("twice");
    assert!(
        e.to_string().contains("destination block 3 is named twice"),
        "{e}"
    );
    let dir = std::env::temp_dir();
    let d1 = LayoutBuilder::new()
        .config(c)
        .fully_contiguous()
        .disk_temp(&dir)
        .build()
        .expect("disk");
    let d2 = LayoutBuilder::new()
        .config(c)
        .fully_contiguous()
        .disk_temp(&dir)
        .build()
        .expect("disk");
    let e = unsafe { copy_blocks(&d1, &[0], &d2, &[0]) }.expect_err("disk to disk");
    assert!(e.to_string().contains("disk to disk"), "{e}");
    for blk in 0..8 {
        assert!(holds(&a, blk, 100 + blk as u64), "block {blk} untouched");
    }
}

/// A staging copy that fails part way (fault injected) and a file that shrank under its layout:
/// the move fails with how far it got, every block stays where it was, the slots taken go back;
/// the same moves succeed afterwards.
pub fn failed_moves_roll_back(backend: Arc<dyn Backend>) {
    let faults = Arc::new(FaultInjector::new(backend.clone()));
    let faulty: Arc<dyn Backend> = faults.clone();
    let p = pool(&faulty);
    let c = config(16);
    let dir = std::env::temp_dir();
    let tiers = KvTiers::new(vec![
        on_pool(&p, c, LayoutKind::LayerSeparate(BlockDim::Second)),
        LayoutBuilder::new()
            .config(c)
            .layer_separate(BlockDim::Second)
            .pinned(&p, false)
            .build()
            .expect("pinned"),
        LayoutBuilder::new()
            .config(c)
            .layer_separate(BlockDim::Second)
            .disk_temp(&dir)
            .build()
            .expect("disk"),
    ])
    .expect("tiers");
    let ids: Vec<u64> = (0..6)
        .map(|_| {
            let (id, at) = tiers.insert(0).expect("slot");
            fill(tiers.tier(0).expect("tier 0"), at.slot, id + 7);
            id
        })
        .collect();
    let before: Vec<_> = ids.iter().map(|&id| tiers.locate(id)).collect();
    faults.fail_copy_nth(3);
    let e = tiers.move_blocks(&ids, 1).expect_err("injected failure");
    match &e {
        Error::TierMoveFailed {
            copied,
            bytes,
            blocks,
            source,
            ..
        } => {
            assert_eq!(*blocks, 6);
            assert!(copied < bytes, "{e}");
            assert!(source.to_string().contains("FAULT_INJECTED"), "{e}");
        }
        other => panic!("expected TierMoveFailed, got {other:?}"),
    }
    let after: Vec<_> = ids.iter().map(|&id| tiers.locate(id)).collect();
    assert_eq!(before, after, "every block where it was");
    assert_eq!(tiers.free_slots(1), 16, "the host slots went back");
    assert!(ids.iter().all(|&id| !tiers.is_moving(id)));
    // Now it works, and then on to disk.
    tiers.move_blocks(&ids, 1).expect("to host");
    tiers.move_blocks(&ids[..4], 2).expect("to disk");
    assert_eq!(
        (
            tiers.free_slots(0),
            tiers.free_slots(1),
            tiers.free_slots(2)
        ),
        (16, 14, 12)
    );
    // The file shrinks under the layout: onboarding from it fails, nothing changes.
    let (_, fd) = tiers.tier(2).expect("disk").file().expect("file");
    // SAFETY: shrinking the test's own open file; no memory depends on its length.
    assert_eq!(unsafe { libc::ftruncate(fd, 4096) }, 0);
    let before: Vec<_> = ids.iter().map(|&id| tiers.locate(id)).collect();
    let e = tiers.move_blocks(&ids[..4], 1).expect_err("short file");
    assert!(e.to_string().contains("pread"), "{e}");
    assert_eq!(
        before,
        ids.iter().map(|&id| tiers.locate(id)).collect::<Vec<_>>()
    );
    assert_eq!(
        (
            tiers.free_slots(0),
            tiers.free_slots(1),
            tiers.free_slots(2)
        ),
        (16, 14, 12)
    );
    // The blocks still on the host tier come home intact.
    tiers.move_blocks(&ids[4..], 0).expect("host -> pool");
    for &id in &ids[4..] {
        let at = tiers.locate(id).expect("known");
        assert_eq!(at.tier, 0);
        assert!(
            holds(tiers.tier(0).expect("tier 0"), at.slot, id + 7),
            "block {id}"
        );
    }
    let e = tiers.move_blocks(&[ids[4], ids[4]], 1).expect_err("twice");
    assert!(e.to_string().contains("named twice"), "{e}");
    let e = tiers.move_blocks(&[999], 1).expect_err("unknown");
    assert!(e.to_string().contains("no block 999"), "{e}");
    let e = tiers.move_blocks(&ids[4..], 3).expect_err("no tier");
    assert!(
        matches!(
            e,
            Error::OutOfLayout {
                what: "tier",
                index: 3,
                count: 3
            }
        ),
        "{e}"
    );
}

/// Eight threads move their own blocks between the three tiers at random, and fight over a
/// few shared ones, for many rounds: every move is all or nothing, the books add up, and every
/// block comes home byte-exact.
pub fn tiers_under_many_threads(backend: Arc<dyn Backend>) {
    let p = pool(&backend);
    let c = config(64);
    let kind = LayoutKind::LayerSeparate(BlockDim::First);
    let dir = std::env::temp_dir();
    let tiers = Arc::new(
        KvTiers::new(vec![
            on_pool(&p, c, kind),
            LayoutBuilder::new()
                .config(c)
                .kind(kind)
                .pinned(&p, true)
                .build()
                .expect("pinned"),
            LayoutBuilder::new()
                .config(c)
                .kind(kind)
                .disk_temp(&dir)
                .build()
                .expect("disk"),
        ])
        .expect("tiers"),
    );
    let ids: Vec<u64> = (0..40)
        .map(|_| {
            let (id, at) = tiers.insert(0).expect("slot");
            fill(tiers.tier(0).expect("tier 0"), at.slot, id * 3 + 1);
            id
        })
        .collect();
    let shared: Vec<u64> = ids[32..].to_vec();
    let refused = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let tiers = tiers.clone();
            let own: Vec<u64> = ids[t as usize * 4..t as usize * 4 + 4].to_vec();
            let shared = &shared;
            let refused = &refused;
            s.spawn(move || {
                let mut rng = Rng::new(t + 1);
                for _ in 0..40 {
                    let to = (rng.next() % 3) as usize;
                    let mut set: Vec<u64> = own
                        .iter()
                        .copied()
                        .filter(|_| rng.next() % 2 == 0)
                        .collect();
                    if rng.next() % 3 == 0 {
                        set.push(shared[(rng.next() % shared.len() as u64) as usize]);
                    }
                    match tiers.move_blocks(&set, to) {
                        Ok(_) => {
                            // Shared blocks may have moved on since; own ones are ours.
                            for id in set.iter().filter(|id| own.contains(id)) {
                                assert_eq!(tiers.locate(*id).expect("known").tier, to);
                            }
                        }
                        Err(Error::InvalidArgument(m)) if m.contains("being moved") => {
                            refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        // Device to disk (on a GPU): refused up front, nothing changed.
                        Err(Error::InvalidArgument(m)) if m.contains("GPUDirect") => {}
                        Err(e) => panic!("thread {t}: {e}"),
                    }
                }
            });
        }
    });
    let used: usize = (0..3).map(|t| 64 - tiers.free_slots(t)).sum();
    assert_eq!(used, ids.len(), "every block holds exactly one slot");
    // Through the host tier (a GPU has no path from disk to the device), then home.
    tiers.move_blocks(&ids, 1).expect("all to the host");
    tiers.move_blocks(&ids, 0).expect("all home");
    for &id in &ids {
        let at = tiers.locate(id).expect("known");
        assert!(
            holds(tiers.tier(0).expect("tier 0"), at.slot, id * 3 + 1),
            "block {id} intact"
        );
    }
    println!(
        "{} moves refused while the same shared block was moving",
        refused.load(std::sync::atomic::Ordering::Relaxed)
    );
}

/// The elastic host tier: a pool over VMM host memory of the device (on CUDA) or pinned host
/// memory (elsewhere, said by its backend), layouts on it pinned; blocks go device -> host
/// tier -> disk -> host tier -> device byte-exact; its budget refuses a layout that does not
/// fit with the numbers, and leaves nothing mapped; many threads filling it never pass the
/// budget, and everything comes back when they are done.
pub fn host_tier_moves_and_budget(backend: Arc<dyn Backend>) {
    let p = pool(&backend);
    let ordinal = backend.info().device_ordinal.unwrap_or(0);
    let budget = 16 << 20;
    let tier = Pool::host_tier(ordinal, PoolConfig::new(256 << 20).physical_limit(budget))
        .expect("host tier");
    let info = tier.backend_info();
    assert!(
        info.page_locked && info.memory_kind == MemoryKind::Host,
        "{info:?}"
    );
    println!("host tier: {}", info.device_name);
    let c = config(32); // 256 KiB per layout
    let kind = LayoutKind::LayerSeparate(BlockDim::First);
    let dev = on_pool(&p, c, kind);
    let host = on_pool(&tier, c, kind);
    assert_eq!(host.storage(), StorageKind::Pinned);
    let disk = LayoutBuilder::new()
        .config(c)
        .kind(kind)
        .disk_temp(std::env::temp_dir())
        .build()
        .expect("disk");
    for blk in 0..32 {
        fill(&dev, blk, blk as u64 + 50);
    }
    let ids: Vec<usize> = (0..32).step_by(3).collect();
    // SAFETY (each move): the test's own layouts, used by nothing else.
    unsafe { copy_blocks(&dev, &ids, &host, &ids) }.expect("device -> host tier");
    unsafe { copy_blocks(&host, &ids, &disk, &ids) }.expect("host tier -> disk");
    unsafe { copy_blocks(&disk, &ids, &host, &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) }
        .expect("disk -> host tier");
    let back: Vec<usize> = (1..32).step_by(3).collect();
    unsafe { copy_blocks(&host, &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], &dev, &back) }
        .expect("host tier -> device");
    for (i, &b) in back.iter().enumerate() {
        assert!(
            holds(&dev, b, ids[i] as u64 + 50),
            "block {} back at {b}",
            ids[i]
        );
    }
    drop(host);
    // A layout over the budget: refused with the numbers, nothing left mapped.
    let big = LayoutBuilder::new()
        .config(config(4096)) // 32 MiB
        .kind(kind)
        .map_region(&tier, &MemOptions::new())
        .build()
        .expect_err("over the host budget");
    assert!(big.is_out_of_memory(), "{big}");
    assert_eq!(tier.stats().mapped, 0, "nothing left mapped: {big}");
    // Many threads filling the tier: never past the budget; all of it comes back.
    let g = tier.granularity() as usize;
    let peak = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                let mut held = Vec::new();
                for _ in 0..16 {
                    match tier.allocate(g) {
                        Ok(a) => held.push(a),
                        Err(e) => assert!(e.is_out_of_memory(), "{e}"),
                    }
                    let mapped = tier.stats().mapped;
                    assert!(
                        mapped <= budget,
                        "{mapped} bytes mapped over a budget of {budget}"
                    );
                    peak.fetch_max(mapped, std::sync::atomic::Ordering::Relaxed);
                }
                drop(held);
            });
        }
    });
    assert!(peak.into_inner() > 0);
    tier.trim().expect("trim");
    assert_eq!(tier.stats().mapped, 0, "everything given back");
}

/// Two pools sleep through one host tier whose budget holds one of them: no pinning of their
/// own; while the first sleeps the second's sleep is refused (the tier is full) and it stays
/// awake, intact; once the first wakes and gives its host memory back, the second sleeps in
/// that memory. Contents come back byte-exact. A tier that is not page-locked is refused.
pub fn sleep_stages_through_the_host_tier(backend: Arc<dyn Backend>) {
    const MIB: usize = 1 << 20;
    let ordinal = backend.info().device_ordinal.unwrap_or(0);
    let g = backend.info().granularity.max(2 * MIB);
    let bytes = 4 * g;
    let tier = Pool::host_tier(
        ordinal,
        PoolConfig::new(64 * g).physical_limit((bytes + bytes / 2) as u64),
    )
    .expect("host tier");
    let model = |tag: u8| {
        let p = pool(&backend);
        p.stage_through(Some(tier.clone()))
            .expect("stage through the tier");
        let mut a = p.allocate(bytes).expect("memory");
        let data: Vec<u8> = (0..bytes).map(|i| (i as u8).wrapping_mul(tag)).collect();
        a.write(0, &data).expect("write");
        (p, a, data)
    };
    let (pa, aa, da) = model(3);
    let (pb, ab, db) = model(5);
    let r = pa
        .sleep(&SleepPolicy::offload_all())
        .expect("A sleeps through the tier");
    assert!(r.offloaded >= bytes as u64, "{r:?}");
    assert!(
        tier.stats().mapped >= bytes as u64,
        "A's copy lives in the tier: {:?}",
        tier.stats()
    );
    let e = pb
        .sleep(&SleepPolicy::offload_all())
        .expect_err("the tier is full");
    assert!(
        e.is_out_of_memory() || e.to_string().contains("limit"),
        "{e}"
    );
    let mut back = vec![0u8; bytes];
    ab.read(0, &mut back).expect("B awake");
    assert!(back == db, "B intact after its refused sleep");
    pa.wake(AfterWake::FreeHostMemory).expect("A wakes");
    aa.read(0, &mut back).expect("read A");
    assert!(back == da, "A byte-exact");
    pb.sleep(&SleepPolicy::offload_all())
        .expect("B sleeps in the memory A gave back");
    pb.wake(AfterWake::FreeHostMemory).expect("B wakes");
    ab.read(0, &mut back).expect("read B");
    assert!(back == db, "B byte-exact");
    assert!(
        tier.stats().peak_physical <= (bytes + bytes / 2) as u64,
        "within the budget: {:?}",
        tier.stats()
    );
    // Not a host tier: refused.
    let plain = Pool::host(64 << 20).expect("plain host pool");
    let e = pa.stage_through(Some(plain)).expect_err("pageable memory");
    assert!(e.to_string().contains("not page-locked"), "{e}");
    pa.stage_through(None)
        .expect("back to the backend's staging");
}

/// A host tier made ready once for the process (`Pool::prefill`, its chunks created on several
/// threads where the backend does: 8 chunks of 32 MiB on CUDA) serves the sleeps of two models
/// with no driver call on the tier, rounds after rounds, each model giving its host memory back
/// to the tier as it wakes; contents come back byte-exact.
pub fn a_prefilled_tier_serves_sleeps_with_no_driver_call(backend: Arc<dyn Backend>) {
    const MIB: usize = 1 << 20;
    let ordinal = backend.info().device_ordinal.unwrap_or(0);
    let g = backend.info().granularity.max(2 * MIB);
    let bytes = 4 * g;
    let tier = Pool::host_tier(ordinal, PoolConfig::new(512 * MIB).max_chunk(32 * MIB))
        .expect("host tier");
    let ahead = if backend.info().memory_kind == MemoryKind::Device {
        256 * MIB
    } else {
        2 * bytes
    };
    let made = tier.prefill(ahead as u64).expect("prefill");
    assert!(made >= ahead as u64, "{made} bytes made for {ahead}");
    let models: Vec<_> = [3u8, 5]
        .into_iter()
        .map(|tag| {
            let p = pool(&backend);
            p.stage_through(Some(tier.clone()))
                .expect("stage through the tier");
            let mut a = p.allocate(bytes).expect("memory");
            let data: Vec<u8> = (0..bytes).map(|i| (i as u8).wrapping_mul(tag)).collect();
            a.write(0, &data).expect("write");
            (p, a, data)
        })
        .collect();
    let before = tier.stats().driver_calls;
    for round in 0..3 {
        for (p, a, data) in &models {
            let r = p.sleep(&SleepPolicy::offload_all()).expect("sleeps");
            assert!(r.offloaded >= bytes as u64, "round {round}: {r:?}");
            p.wake(AfterWake::FreeHostMemory).expect("wakes");
            let mut back = vec![0u8; bytes];
            a.read(0, &mut back).expect("read");
            assert!(back == *data, "round {round}: byte-exact");
        }
    }
    let calls = tier.stats().driver_calls.since(&before);
    assert_eq!(calls.total(), 0, "no driver call on the tier: {calls:?}");
    for (p, _, _) in &models {
        p.audit().expect("audit");
    }
    tier.audit().expect("tier audit");
}

/// A pool under a tier cannot sleep while a move copies its memory (the sleep is refused,
/// naming the moves), and a move is refused, nothing changed, while the pool is asleep. Five
/// rounds of a move (32 MiB to disk on the host, 512 MiB to the host tier on a GPU) with sleeps
/// attempted throughout: without the guard a sleep would unmap the memory under the copy.
pub fn tier_pools_do_not_sleep_under_a_move(backend: Arc<dyn Backend>) {
    let g = backend.info().granularity;
    let device = backend.info().memory_kind == MemoryKind::Device;
    // 256 KiB blocks: 32 MiB to disk on the host, 512 MiB to the host tier on a GPU (both take
    // milliseconds).
    let n = if device { 2048 } else { 128 };
    let p = Pool::new(
        backend.clone(),
        PoolConfig::new(64 * g + n * (256 << 10)).growth_divisor(0),
    )
    .expect("pool");
    let c = LayoutConfig::new(n, 1, 1, 16, 8192, 2);
    let tier = Pool::host_tier(
        backend.info().device_ordinal.unwrap_or(0),
        PoolConfig::new(n * (256 << 10) + 64 * g),
    )
    .expect("host tier");
    let second = if device {
        on_pool(&tier, c, LayoutKind::FullyContiguous)
    } else {
        LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .disk_temp(std::env::temp_dir())
            .build()
            .expect("disk")
    };
    let tiers =
        KvTiers::new(vec![on_pool(&p, c, LayoutKind::FullyContiguous), second]).expect("tiers");
    let ids: Vec<u64> = (0..n).map(|_| tiers.insert(0).expect("slot").0).collect();
    for &id in &ids {
        fill(
            tiers.tier(0).expect("tier 0"),
            tiers.locate(id).expect("known").slot,
            id,
        );
    }
    let mut refused_sleeps = 0;
    for _ in 0..5 {
        let (moved, refused) = std::thread::scope(|s| {
            let mover = s.spawn(|| tiers.move_blocks(&ids, 1));
            let mut refused = 0;
            while !mover.is_finished() {
                if !tiers.is_moving(ids[0]) {
                    std::thread::yield_now();
                    continue;
                }
                match p.sleep(&SleepPolicy::offload_all()) {
                    Err(Error::SleepRefused { reason, .. }) if reason.contains("KvTiers") => {
                        refused += 1
                    }
                    Err(e) => panic!("unexpected sleep error: {e}"),
                    Ok(_) => {
                        // Only before the move counted itself in (it is then refused) or
                        // after its copies were done (it then succeeds).
                        let r = mover.join().expect("mover");
                        assert!(matches!(r, Ok(_) | Err(Error::Asleep { .. })), "{r:?}");
                        p.wake(AfterWake::KeepHostMemory).expect("wake");
                        return (r.is_ok(), refused);
                    }
                }
            }
            mover.join().expect("mover").expect("move");
            (true, refused)
        });
        refused_sleeps += refused;
        if moved {
            tiers.move_blocks(&ids, 0).expect("back");
        }
        for &id in &ids {
            let at = tiers.locate(id).expect("known");
            assert_eq!(at.tier, 0);
            assert!(
                holds(tiers.tier(0).expect("tier 0"), at.slot, id),
                "block {id}"
            );
        }
    }
    assert!(refused_sleeps > 0, "no sleep ever met a running move");
    // Asleep: a move is refused and nothing changes.
    p.sleep(&SleepPolicy::offload_all()).expect("sleep");
    let e = tiers.move_blocks(&ids[..4], 1).expect_err("asleep");
    assert!(matches!(e, Error::Asleep { .. }), "{e}");
    assert_eq!((tiers.free_slots(0), tiers.free_slots(1)), (0, n));
    p.wake(AfterWake::KeepHostMemory).expect("wake");
    tiers.move_blocks(&ids[..4], 1).expect("awake again");
}

/// Whether every byte of `block` of a pool layout is `b`.
fn all_bytes(l: &Layout, block: usize, b: u8) -> bool {
    l.block(block).expect("block").iter().all(|v| {
        let mut out = vec![0u8; v.len as usize];
        // SAFETY: the view lies in the layout; nobody writes it meanwhile.
        unsafe { l.read(v.addr, &mut out) }.expect("read");
        out.iter().all(|&x| x == b)
    })
}

/// A move starts at once and settles at its wait:
/// - its device copies are ordered after the engine's stream: fills queued on that stream just
///   before (fifty rounds, the last one counts) are what lands in the host tier, with no host
///   wait between (a device backend; elsewhere plain writes);
/// - and before it: once the stream ran past `order_before`, the move is done;
/// - the pool cannot sleep until the move is waited for; two moves under way at once both
///   settle; a dropped one settles too; everything comes home byte-exact.
pub fn moves_start_in_stream_order_and_settle_at_wait(backend: Arc<dyn Backend>) {
    const STREAM: u64 = 2; // the calling thread's default stream
    let p = pool(&backend);
    let c = config(16);
    let tiers = KvTiers::new(vec![
        on_pool(&p, c, LayoutKind::FullyContiguous),
        LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .pinned(&p, false)
            .build()
            .expect("pinned"),
        LayoutBuilder::new()
            .config(c)
            .fully_contiguous()
            .disk_temp(std::env::temp_dir())
            .build()
            .expect("disk"),
    ])
    .expect("tiers");
    let ids: Vec<u64> = (0..8).map(|_| tiers.insert(0).expect("slot").0).collect();
    let dev = tiers.tier(0).expect("tier 0");
    let copies = backend.copies();
    let first = dev.block(0).expect("block")[0];
    // SAFETY: zero bytes: queues nothing; it says whether the backend queues fills.
    let streamed = unsafe { copies.fill_async(first.addr, 0, 0, STREAM) }.is_ok();
    let mark = |id: u64| 0xA0u8.wrapping_add(id as u8);
    for &id in &ids {
        let slot = tiers.locate(id).expect("known").slot;
        for v in dev.block(slot).expect("block") {
            if streamed {
                for round in 0..50u8 {
                    let b = if round == 49 { mark(id) } else { round };
                    // SAFETY: the view is the layout's device memory, used by nothing else;
                    // the move below is ordered after this stream.
                    unsafe { copies.fill_async(v.addr, v.len as usize, b, STREAM) }.expect("fill");
                }
            } else {
                // SAFETY: as above.
                unsafe { dev.write(v.addr, &vec![mark(id); v.len as usize]) }.expect("write");
            }
        }
    }
    let m = if streamed {
        // SAFETY: STREAM is a special handle of this device.
        unsafe { tiers.start_move_after(&ids, 1, STREAM) }.expect("start")
    } else {
        // No device makes these copies: ordering them after a stream is refused, nothing
        // changed.
        // SAFETY: refused before any stream is used.
        let e = unsafe { tiers.start_move_after(&ids, 1, STREAM) }.expect_err("no device");
        assert!(e.to_string().contains("no device copy"), "{e}");
        assert!(ids.iter().all(|&id| !tiers.is_moving(id)));
        tiers.start_move(&ids, 1).expect("start")
    };
    assert_eq!(m.destinations().len(), 8);
    let e = p
        .sleep(&SleepPolicy::offload_all())
        .expect_err("asleep under a move");
    assert!(e.to_string().contains("KvTiers"), "{e}");
    let dest = m.destinations().to_vec();
    let r = m.wait().expect("to host");
    assert_eq!((r.blocks, r.copies), (8, 1), "one run, one copy");
    let host = tiers.tier(1).expect("tier 1");
    for (id, at) in dest {
        assert_eq!(tiers.locate(id), Some(at));
        for v in host.block(at.slot).expect("block") {
            // SAFETY: the pinned layout's host memory, written by nobody now.
            let got = unsafe { std::slice::from_raw_parts(v.addr as *const u8, v.len as usize) };
            assert!(
                got.iter().all(|&b| b == mark(id)),
                "block {id}: the last fill did not land"
            );
        }
    }
    // Two moves to disk under way at once.
    let a = tiers.start_move(&ids[..4], 2).expect("start a");
    let b = tiers.start_move(&ids[4..], 2).expect("start b");
    assert_eq!(tiers.moves_under_way(), 2);
    b.wait().expect("b");
    a.wait().expect("a");
    assert_eq!(tiers.free_slots(2), 8);
    tiers.move_blocks(&ids, 1).expect("disk -> host");
    // Onboard, the stream ordered after it, the handle dropped unwaited.
    let m = tiers.start_move(&ids, 0).expect("onboard");
    // SAFETY: as above.
    unsafe { m.order_before(STREAM) }.expect("order");
    if streamed {
        copies.synchronize(STREAM).expect("sync");
        assert!(
            m.is_done(),
            "the stream ran past the move, which is not done"
        );
    }
    drop(m);
    assert_eq!(tiers.moves_under_way(), 0);
    for &id in &ids {
        let at = tiers.locate(id).expect("known");
        assert_eq!(at.tier, 0);
        assert!(
            all_bytes(dev, at.slot, mark(id)),
            "block {id} came home changed"
        );
    }
    p.sleep(&SleepPolicy::offload_all())
        .expect("sleeps once no move is under way");
    p.wake(AfterWake::KeepHostMemory).expect("wake");
}
