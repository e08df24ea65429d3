//! Resident memory really drops when the pool gives memory back (its own test binary, so no other
//! test's memory moves the process's numbers meanwhile).

use std::sync::Arc;

use elastic_vmm::backend::host::HostBackend;
use elastic_vmm::{AfterWake, Backend, MemOptions, Pool, PoolConfig, SleepPolicy, Tag};

/// `(VmRSS, RssShmem)` of this process in bytes, from `/proc/self/status`. Differences below
/// saturate: resident memory can move either way, and a drop where a rise was expected must fail
/// the assertion with its message, not panic on overflow (the suite runs with overflow checks).
fn resident() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let field = |key: &str| -> u64 {
        let line = status
            .lines()
            .find(|l| l.starts_with(key))
            .unwrap_or_else(|| panic!("{key} missing"));
        line.split_whitespace()
            .nth(1)
            .expect("value")
            .parse::<u64>()
            .expect("number")
            .checked_mul(1024)
            .expect("a resident size in bytes fits in u64")
    };
    (field("VmRSS:"), field("RssShmem:"))
}

#[test]
fn resident_memory_drops_after_unmap_and_trim() {
    let _alone = ALONE.lock();
    const MIB: u64 = 1 << 20;
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::new(2 << 20).expect("host"));
    let pool = Pool::new(backend.clone(), PoolConfig::new(8 << 30)).expect("pool");
    let (rss0, shmem0) = resident();

    // Allocator path: 256 MiB touched through allocations.
    let mut allocs = Vec::new();
    for i in 0..64 {
        let mut a = pool.allocate((4 * MIB) as usize).expect("allocate");
        a.fill(i as u8 + 1).expect("touch every page");
        allocs.push(a);
    }
    // Range path: 128 MiB mapped and touched.
    pool.map(4 << 30, 128 * MIB).expect("map");
    // SAFETY: the range was just mapped and nothing else uses it.
    unsafe {
        backend
            .copies()
            .fill(pool.base() + (4 << 30), (128 * MIB) as usize, 7)
            .expect("touch")
    };
    let (rss1, shmem1) = resident();
    println!("before: VmRSS {rss0} RssShmem {shmem0}; loaded: VmRSS {rss1} RssShmem {shmem1}");
    assert!(
        shmem1.saturating_sub(shmem0) >= 380 * MIB,
        "384 MiB touched should be resident: {:+} bytes",
        i128::from(shmem1) - i128::from(shmem0)
    );
    assert!(backend.physical_bytes().expect("blocks") >= 384 * MIB);

    drop(allocs);
    pool.unmap(4 << 30, 128 * MIB).expect("unmap");
    // Freed memory is idle/cached, still held: nothing given back before trim.
    assert!(pool.stats().physical() >= 384 * MIB);
    let report = pool.trim().expect("trim");
    assert!(
        report.released >= 384 * MIB,
        "trim released only {}",
        report.released
    );
    let (rss2, shmem2) = resident();
    println!("after unmap + trim: VmRSS {rss2} RssShmem {shmem2}");
    assert!(
        shmem1.saturating_sub(shmem2) >= 380 * MIB,
        "RssShmem dropped only {} bytes",
        i128::from(shmem1) - i128::from(shmem2)
    );
    assert!(
        rss1.saturating_sub(rss2) >= 380 * MIB,
        "VmRSS dropped only {} bytes",
        i128::from(rss1) - i128::from(rss2)
    );
    assert_eq!(
        backend.physical_bytes().expect("blocks"),
        0,
        "the memfd holds no blocks any more"
    );
    assert_eq!(pool.stats().physical(), 0);
}

/// `RssShmem` of this process in bytes (memfd pages resident), from `/proc/self/status`.
fn shmem() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("RssShmem:"))
        .expect("RssShmem");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .expect("value")
        .parse()
        .expect("number");
    kib.checked_mul(1024).expect("fits")
}

/// Two tests in this binary: each holds this while it measures, so neither moves the other's
/// numbers.
static ALONE: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

#[test]
fn resident_memory_follows_sleep_and_wake() {
    const MIB: u64 = 1 << 20;
    let _alone = ALONE.lock();
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::new(2 << 20).expect("host"));
    let pool = Pool::new(backend.clone(), PoolConfig::new(4 << 30)).expect("pool");
    let mut a = pool
        .allocate_with((256 * MIB) as usize, &MemOptions::new().tag(Tag::Weights))
        .expect("allocate");
    a.fill(0x5a).expect("touch every page");
    let loaded = shmem();
    pool.sleep(&SleepPolicy::offload_all()).expect("sleep");
    let asleep = shmem();
    println!("loaded {loaded}, asleep {asleep}");
    assert!(
        loaded.saturating_sub(asleep) >= 240 * MIB,
        "sleep should drop ~256 MiB of resident memfd pages: {loaded} -> {asleep}"
    );
    assert_eq!(backend.physical_bytes().expect("blocks"), 0);
    pool.wake(AfterWake::FreeHostMemory).expect("wake");
    let woken = shmem();
    println!("woken {woken}");
    assert!(
        woken.saturating_sub(asleep) >= 240 * MIB,
        "wake should bring ~256 MiB back: {asleep} -> {woken}"
    );
    let mut out = vec![0u8; (256 * MIB) as usize];
    a.read(0, &mut out).expect("read");
    assert!(out.iter().all(|&b| b == 0x5a), "contents differ after wake");
}
